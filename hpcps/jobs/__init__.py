"""Batch job scripts for Slurm, PBS, LSF and plain mpiexec, rendered from the templates here."""
