"""Process lifecycle: the `epd` command, `epd serve`'s launcher, one role process's server, readiness, start-up
checks, announcing, the event loop, private folders.
"""
