"""The observability wing: what a loader did, recorded as it runs and read afterwards.

One module per kind, and the recorders import the readers, never the reverse
(tests/test_import_graph.py holds the rule):

- recorders, on the hot path of every step: `tracer` (a traced loader's `Tracer`, and the
  process-wide list of tracers that `python -m statecore profile` writes out) and `flight`
  (every driver's `FlightRecorder`, the ring of its last scheduler events, written out when
  something breaks);
- readers, pure: `trace` (`Trace`, `LoaderStats`, the verdict and what to try), `chrome` (a
  trace in Chrome's trace event format) and `flightfile` (the flight file's format and its
  replay through `step`);
- the seam, `seam`: the hooks (`Observer`, one per event type it wants) through which the
  loader attaches the recorders to a driver, which tells each of them of every transition
  once, looking the event's type up once for all of them (`observed`).

docs/profiling.md and docs/flight-recorder.md say what each gives and what it costs.
"""
