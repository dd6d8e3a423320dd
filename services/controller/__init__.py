"""Reconfiguration controller (§6): pure cores, no IO.

* ``lattice``      — buddy lattice, :class:`Composition`, adjacent split/merge operations.
* ``windows``      — observation windows and the demand D(k), long-request fraction.
* ``composition``  — capacity Σ κ_C and the initial composition from history (§6.1).
* ``planner``      — per-window split/merge decision, :class:`ControllerConfig`, :class:`Plan`.
* ``lifecycle``    — worker lifecycle and epoch protocol (transition tables, acks).
* ``core``         — the above wired together for the adapter and the simulator.
"""
