"""Checking a run: the float64 evaluation read from the checkpoint (``reference``), what ``run``'s check
covers and the memory it needs (``plan``), and the verdict every rank agrees on (``verdict``).
"""
