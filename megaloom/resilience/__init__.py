"""Resilience in the style of MegaScale: detect, diagnose and recover from failures without a person.

faults    -- fault injection for tests and drills (MEGALOOM_FAULT)
watchdog  -- hang detection with a report of who is stuck where, then a non-zero exit for torchrun to restart
straggler -- per-rank compute time compared against the median
doctor    -- pre-flight self-check: matmul throughput and collective bandwidth per rank
"""
