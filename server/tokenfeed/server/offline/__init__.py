"""Offline builds of the token store: `tokenfeed build` on every core of this machine, and on a
Ray cluster (`--ray`)."""
