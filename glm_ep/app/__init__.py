"""The ``glm-ep`` command line: argument parsing and dispatch (``cli``), the ``run`` and ``forward`` jobs
(``jobs``), their input and output files (``files``), the one-process ``synth``, ``make-input`` and ``footprint``
(``local_jobs``) and the per-rank byte counts of ``footprint`` (``footprint``), what the launcher says before MPI
starts (``launcher``), ``--expert-load`` (``load_record``) and ``balance`` (``balance_job``).
"""
