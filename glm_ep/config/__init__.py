"""Configuration: the model's geometry from ``config.json`` (``model``), topology files and path levers
(``topology``), the topologies shipped in ``configs/`` (``shipped``), and the synthetic presets
(``presets``). Small, frozen, explicit: nothing here reads the environment or touches a device.
"""
