"""Scale-out on Ray Serve: engine replicas behind an OpenAI ingress, routed by prefix and load.

replica.py      EngineReplica: one AsyncLLMEngine per Ray Serve replica; streams outputs, reports load
client.py       RemoteEngineClient: the serving layer's EngineClient over a deployment handle
router.py       PrefixAwareRouter: Ray Serve's RequestRouter API over serving/routing.py's policy
autoscaling.py  a Ray Serve autoscaling policy on engine load (running + waiting requests, KV usage)
metrics.py      the replicas' Prometheus metrics (carried on their load reports) and the routers' decisions
ingress.py      OpenAIIngress: the OpenAI routes (entrypoints/openai) over RemoteEngineClient
app.py          RayAppOptions and the application builder (also for `serve run` and Serve config files)
launch.py       `batchserve serve --replicas N`: a local Ray instance (or --ray-address), the app, until Ctrl-C
"""
