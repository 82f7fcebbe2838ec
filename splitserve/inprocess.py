"""The scheduler core and the model runner wired together in one process, no gRPC.

Used by tests (the reference the services must match), benchmarks and the simulator.
"""

from __future__ import annotations

from collections.abc import Callable

from scheduler_svc.core import Request, SamplingParams, Scheduler, SchedulerConfig


class InProcessEngine:
    """A Scheduler driving a ModelRunner step by step."""

    def __init__(
        self, runner, scheduler_config: SchedulerConfig | None = None, **overrides
    ) -> None:
        self.runner = runner
        if scheduler_config is None:
            scheduler_config = SchedulerConfig(
                **{
                    "max_num_batched_tokens": 512,
                    "max_num_seqs": 64,
                    "block_size": runner.block_size,
                    "num_blocks": runner.num_blocks,
                    "num_host_blocks": runner.num_host_blocks,
                    "max_model_len": runner.max_model_len,
                    **overrides,
                }
            )
        self.scheduler = Scheduler(scheduler_config)
        self.outputs: dict[str, list[int]] = {}
        self.finish_reasons: dict[str, str] = {}

    def add(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, **kwargs
    ) -> None:
        self.scheduler.add_request(
            Request(
                request_id=request_id,
                prompt_token_ids=prompt_token_ids,
                sampling_params=params,
                eos_token_id=self.runner.eos_token_id,
                **kwargs,
            )
        )
        self.outputs[request_id] = []

    def step(self) -> list:
        out = self.scheduler.schedule()
        result = self.runner.execute_model(out)
        finished = self.scheduler.update_from_output(out, result.sampled_token_ids)
        for o in finished:
            self.outputs[o.request_id].extend(o.new_token_ids)
            if o.finish_reason is not None:
                self.finish_reasons[o.request_id] = str(o.finish_reason)
        return finished

    def run(self, on_step: Callable[[list], None] | None = None) -> dict[str, list[int]]:
        while self.scheduler.has_unfinished_requests():
            outs = self.step()
            if on_step is not None:
                on_step(outs)
        self.step()  # let the runner drop the finished rows
        return self.outputs


def generate_in_process(
    prompts: list[list[int]],
    max_tokens: int = 16,
    num_blocks: int = 256,
    model: str | None = None,
    runner=None,
    **scheduler_overrides,
) -> list[list[int]]:
    """Greedy, EOS ignored: the token ids each prompt produces."""
    if runner is None:
        from worker_svc.config import ModelRunnerConfig
        from worker_svc.model_runner import ModelRunner

        runner = ModelRunner(ModelRunnerConfig(model=model, num_gpu_blocks=num_blocks))
    engine = InProcessEngine(runner, **scheduler_overrides)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add(f"p{i}", prompt, params)
    outputs = engine.run()
    return [outputs[f"p{i}"] for i in range(len(prompts))]
