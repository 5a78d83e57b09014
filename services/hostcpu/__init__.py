"""How role processes share the host's CPUs: threads per role, the OpenMP team, niceness, the compute lease.
"""
