"""pagoda's Kubernetes operator: the `LLMService` CRD, its renderers, handlers and autoscaler.

Layout:
    crd.py             the CRD (single source; the chart's copy is generated from it)
    crd_status.py      the CRD's status schema (what the operator writes under .status)
    schema_nodes.py    builders of OpenAPI schema nodes the CRD schemas are made of
    spec.py            parse + validate an LLMService spec into dataclasses (SpecError)
    naming.py          object names and labels shared by every renderer
    render_replicas.py replica Deployment + headless Service   (pure render_* functions)
    render_router.py   router Deployment, Service and its RBAC (pure render_* functions)
    render_kserve.py   InferenceService for mode KServe         (pure render_* functions)
    parallelism.py     spec.parallelism: schema, rules, GPU limit and `pagoda serve` flags per pod
    render_groups.py   LeaderWorkerSet of multi-node replicas   (pure render_* functions)
    fleet_keys.py      Redis key names the autoscaler reads and writes (one builder)
    load.py            replica load: Redis heartbeats, /metrics scrape fallback
    autoscaler.py      the scaling policy (pure; injected clock)
    drain.py           scale-in drain state machine (pure)
    kube.py            a small async Kubernetes API client over aiohttp
    handlers.py        kopf handlers: reconcile + autoscale timer (thin)
    main.py            `pagoda operator` entry point
"""
