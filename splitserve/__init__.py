"""The composition root: the `splitserve` command (cli.py), `splitserve up` (launcher.py: a
scheduler and N workers as child processes) and the two cores wired in one process without
gRPC (inprocess.py). The only package that may import from every layer; no layer imports it.

Layers, imports pointing down only (tests/unit/test_layers.py checks them):

    composition root   splitserve/ (this package)
    services           scheduler_svc/ (outside core/), worker_svc/link.py and worker_svc/main.py
    cores              scheduler_svc/core/  |  worker_svc/ (the model, its kernels)
    wire types         common/ (protobuf in common/pb, messages.py, convert.py, ...)

The front-end process that the scheduler-HA work introduces is a third service: it goes in
frontend_svc/ beside scheduler_svc/ and worker_svc/, importing only common/, and is started from
here (`splitserve frontend`, and by `splitserve up`).
"""
