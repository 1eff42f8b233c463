"""Offline: reports over run files, and the discrete-event simulator of the paradigms (no MPI)."""
