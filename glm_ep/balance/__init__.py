"""Expert load balance: what each rank runs and reads of a call, counted (``counting``); the expert load a
workload records and the per-rank load it implies (``expert_load``, ``report``); a load-aware placement of the
experts on the expert-parallel ranks (``eplb``).
"""
