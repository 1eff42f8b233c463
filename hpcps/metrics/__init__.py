"""Run metrics: schema (pure), HDF5 run file (h5py), recorders (MPI)."""
