"""The MLP sites: routing math (``routing``), the routed-expert paths (``dispatch``), the dense and sparse
site forwards, each ending in one all-reduce (``site``), the layer stack (``stack``), its workspace
(``workspace``), and the runtime that loads all of it onto a backend (``runtime``).
"""
