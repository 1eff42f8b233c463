"""MPI mechanism: RMA parameter window, pushes, notices, polite polling.

Nothing in here knows about paradigms; the server and worker loops drive it.
"""
