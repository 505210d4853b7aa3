"""``glm-ep bench``: GPU figures at the GLM-5.3-Flash shape (decode and verify; ``--prefill``)."""
