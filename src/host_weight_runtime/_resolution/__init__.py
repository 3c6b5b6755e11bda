"""The runtime's stages, one small unit each, behind `HostWeightRuntime` (private: import from `runtime`).

Layout:
  decisions.py              the decision table (ALWAYS_FATAL, may_fall_back, StageVerdict -> action), in one place
  stage.py                  StageContext (one resolve's inputs) and StageOutcome (one stage's typed result)
  stage_lookup.py           stage: local lookup
  stage_remote.py           stage: remote import (the configured remotes in order; not tried without one)
  remote_push.py            HWR_REMOTE_PUBLISH: push what this runtime built, off the request path
  stage_build.py            stage: local build (a PRE_LOAD_SAFE producer through get_or_build)
  pipeline.py               RESOLVE_STAGES in order, the DOMAIN step before them and the canonical fallback after
  post_load_publication.py  the post-load publication stage
  resolve_reports.py        attempt records, the terminal conclusion and the one report per call
  store_calls.py            opening the store once; calling it under its contract
  checks.py                 argument checks and the producers V1 refuses

A new stage is a `ResolveStage` (StageContext -> StageOutcome) in its own module, added
at its place in `pipeline.RESOLVE_STAGES`; a result no existing verdict describes gets
a new `StageVerdict` row in `decisions`. No other stage changes.
"""
