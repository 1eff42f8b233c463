"""Training data: built-in and HDF5 data sets, sharding among workers, batch sources (no MPI)."""
