"""Ranks and their collectives: MPI loading (``mpi_lib``), error agreement, logging and abort (``ranks``),
the collective deadline (``deadline``), device placement and the NCCL-or-MPI choice (``placement``),
the all-reduce communicators (``comm``: MPI, one rank; ``nccl``: NCCL), and the reporting rank's
progress output (``progress``: a bar on a terminal, plain lines in a log).
"""
