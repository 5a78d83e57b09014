"""The HTTP edge every role shares: request bodies in, models out, errors mapped once; API keys; llm-d's OpenAI-
format calls.
"""
