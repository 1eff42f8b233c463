"""What is trained and how the servers step it: models, workloads and plug-ins, the flat
parameter buffers, server optimizers with their param groups and schedules, staleness-aware
rates, stopping targets (no MPI)."""
