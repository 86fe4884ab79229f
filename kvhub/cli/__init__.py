"""The kvhub command line (click).  The only layer that prints."""
