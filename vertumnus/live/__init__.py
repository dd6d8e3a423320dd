"""The live system from the command line: ``vertumnus up`` (orchestrator), ``replay``, ``tap``.

* :mod:`vertumnus.live.stack` — start nats-server and every service as child processes, wait
  for health, replay, report, stop (also on Ctrl-C);
* :mod:`vertumnus.live.replay` — drive a gateway over HTTP with a trace or the synthetic
  workload, at scaled time;
* :mod:`vertumnus.live.report` — the TTFT table (sim/metrics.py definitions) and composition
  changes;
* :mod:`vertumnus.live.tap` — print a subject's messages decoded by Content-Type;
* :mod:`vertumnus.live.rankd_sim` — rank daemons timed by the simulator's ground truth;
* :mod:`vertumnus.live.registry` — the services as data (module, settings, env names);
* :mod:`vertumnus.live.procs` — child process supervision (no orphans);
* :mod:`vertumnus.live.startup_profile` — ``up``'s start-up profiling in a child process that
  an interrupt kills at once.
"""
