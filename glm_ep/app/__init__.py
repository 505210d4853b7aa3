"""The ``glm-ep`` command line: argument parsing and dispatch (``cli``), the ``run`` and ``forward`` jobs
(``jobs``), their input and output files (``files``), and the per-rank byte counts of ``footprint``
(``footprint``).
"""
