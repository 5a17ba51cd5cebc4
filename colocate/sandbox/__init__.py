"""The sandbox: one cell realised on this machine (workerd, a local pod, an emulated geography).

    errors.py      SandboxError and its subclasses
    geography.py   sites, the round-trip model (floor x stretch, overrides, same-site floor)
    pinning.py     where each generation was first touched, kept in <state_dir>/pins.json
    proxies.py     the emulated network: front proxy, outbound proxy, pin control endpoint
    js/wrapper.js  sandbox-only Worker entry: the product Worker, its BREAKER namespace wrapped
    config.py      the workerd config composed from the cell plan
    statedir.py    the state directory: its files, the lock, secrets, the owning stack
    launch.py      what ``up`` was asked for (launch.json), the plan and sites derived from it
    processes.py   process groups, signals deferred during cleanups, stopping children, HTTP
                   health checks
    detach.py      the launcher ``up`` runs to start a runner detached (``-m ...detach``)
    pods.py        the cell's pods through scripts/pod.py (pods.json)
    demokey.py     the demo client key (demo-key.json)
    runner.py      the runner: starts every part, rolling apply, cleanup
    supervisor.py  up / apply / down / status, and the runner's entry (``-m ...supervisor run``)
    demo.py        the field story told with the running cell (``make demo``)
    demo_plot.py   the demos' stacked-bar PNG
    fleet_launch.py  what ``up --fleet`` was asked for (fleet-launch.json), the fleet plan from
                   the stack files, the client sites, the members' stack copies with placeholders
    fleet_front.py the fleet's front runner (``-m ...fleet_front run``): the front door's
                   workerd, its entry proxies and its binding proxy (service-binding RTT)
    fleet.py       the fleet: up / apply / down / status of every cell and the front door,
                   the fleet's client key
    fleet_demo.py  three cells behind one front door, one losing its pods (``make demo-fleet``)

The product Worker's bytes are the ones the cloud receives; every delay is added by
the proxies and the wrapper, never inside the router.
"""
