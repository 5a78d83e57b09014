"""Sampling tokens from logits (torch), for prefill's first token and decode's steps: greedy,
temperature/top-p/top-k/min-p, penalties, seeds, logprobs.
"""
