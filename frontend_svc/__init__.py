"""The front-end service: what a client touches, in a process apart from the scheduler."""
