"""Pure scheduling policy: standard library only, time passed in as `now` (monotonic seconds).

The shell feeds a scheduler arrivals (`submit`), departures (`cancel`, `on_done`) and the time,
and carries out what it decides (`schedule`). Nothing here does I/O, reads a clock, or imports
anything outside the standard library and this package.
"""
