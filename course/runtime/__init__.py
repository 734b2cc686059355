"""The machinery that starts ranks and brings their results home: ``launch`` (forked, forkserver
or spawned ranks from a notebook), the worker protocol every rank runs whoever started it, the
live display, real launchers (torchrun, mpirun) as process trees, and the environment they set.
Imports nothing else of the course."""
