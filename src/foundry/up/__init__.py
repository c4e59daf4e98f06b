"""`foundry up`: every service as a local process, one command.

Theory of operation. ``run_stack`` walks one pipeline:

1. check that every port of the layout (``StackPorts``) is free, so a clash is one clear
   error before anything starts;
2. start the coordinator, the gateway, N workers and, when installed, Prometheus, each in its
   own session (process group) with its output in ``RUN_DIR/logs/NAME.log``; a child is
   started once its startup line is in its log;
3. poll the coordinator's admin link (FDTC SWARM_DETAIL_REQ -> SWARM_STATUS + SWARM_DETAIL)
   and draw the live view until the run is DONE, restarting a service that dies (with capped
   backoff; one that failed 5 times within a minute is left down, with the command that
   starts it by hand);
4. export the weights as GGUF (admin EXPORT), start the tensor-parallel pair on that file, and
   generate a greedy sample through the gateway, exactly as `foundry ctl generate` would;
5. serve until SIGINT or SIGTERM, then stop every child: SIGTERM to its process group, SIGKILL
   to whatever is left after the grace period.

Stopping runs in a ``finally``, so it happens whatever ends the pipeline (a signal, a failed
child, a bug). Each child also gets the kernel's parent-death signal (SIGKILL) on Linux, so
even a ``foundry up`` killed with SIGKILL leaves no service behind. The pids are written to
``RUN_DIR/stack.json`` as they start, for tools and tests that want to check on them.

Where each part lives:

- ``plan``: options, port layout, command lines, Prometheus config; pure, tested without
  starting anything;
- ``supervisor``: the children (start, watch, stop) and the free-port check;
- ``view``: status lines and the live view;
- ``clients``: the coordinator's admin link (blocking FDTC) and the gateway generation (gRPC);
- ``pipeline``: ``run_stack``, the steps above in order.
"""
