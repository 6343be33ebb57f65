"""`shoal bench`: a load generator and reporter for any OpenAI-compatible streaming endpoint.

It only speaks HTTP: nothing here imports the engine, torch or other shoal packages.
"""
