"""What generation means, torch-free, for every role: sampling parameters, stop rules, incremental detokenization,
the output judge.
"""
