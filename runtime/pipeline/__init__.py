"""Pipeline parallelism: the one round over P processes, one stage of the target's layers each (torchrun).

  decoder.py     PipelineDecoder: the round split where the data lives (docs/architecture.md, "The pipeline")
  stage.py       PipelineStage: one rank's contiguous layers (embedding on the first, norm and head on the last)
  selection.py   which methods split (PIPELINE_METHODS), Dustin's S_target per stage
  group.py       PipelineGroup: the process group, the start handshake, faults
  layers.py      layer_split: which target layers each stage holds (the engine builder writes its shards by it); the
                 drafting rank may hold fewer
  longspark.py   LongSparkRelay: the LongSpark drafter's layers on later stages, sent round to the first
"""

from trtllm_dustin.runtime.pipeline.decoder import PipelineBench, PipelineDecoder, PipelineSetup
from trtllm_dustin.runtime.pipeline.group import DEFAULT_TIMEOUT_S, PipelineError, PipelineGroup, torchrun_world
from trtllm_dustin.runtime.pipeline.layers import balanced_first_stage, check_split, layer_split
from trtllm_dustin.runtime.pipeline.selection import (
    PIPELINE_METHODS,
    PipelineMethod,
    TargetHistory,
    pipeline_method,
    sum_in_order,
)
from trtllm_dustin.runtime.pipeline.stage import PipelineStage

__all__ = ["DEFAULT_TIMEOUT_S", "PIPELINE_METHODS", "PipelineBench", "PipelineDecoder", "PipelineError",
           "PipelineGroup", "PipelineMethod", "PipelineSetup", "PipelineStage", "TargetHistory", "balanced_first_stage",
           "check_split", "layer_split", "pipeline_method", "sum_in_order", "torchrun_world"]
