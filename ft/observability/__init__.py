"""What ft tells the outside about a run: torchft's record loggers (:mod:`.records`), profiler
spans around the step's phases (:mod:`.spans`) and their OpenTelemetry export (:mod:`.otel`,
also at torchft's path :mod:`ft.otel`). Importing this package loads no torch."""
