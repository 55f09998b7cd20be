"""The offline API, shaped like vLLM's: ``LLM(model=...).generate(prompts, params)``.

``generate`` queues every prompt at once and steps the engine until all finish, so the
prompts are continuously batched together; results come back in input order. A progress
bar counts finished prompts (``use_tqdm``, on by default as vLLM's; ``engine/progress.py``).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Union

from pagoda.engine.core.load_shedding import EngineOverloaded
from pagoda.engine.config import EngineConfig
from pagoda.engine.llm_engine import LLMEngine, PromptType
from pagoda.engine.outputs import RequestOutput
from pagoda.engine.progress import NoProgress, Progress, UseTqdm, make_progress
from pagoda.engine.sampling_params import SamplingParams


class LLM:
    """Offline batched generation.

    Args:
        model: a Hugging Face model folder; None uses the default model (SmolLM2-135M-Instruct).
        **engine_kwargs: any ``EngineConfig`` field (block_size, max_num_seqs, ...).
    """

    def __init__(self, model: Optional[str] = None, **engine_kwargs: Any) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **engine_kwargs))
        self.engine.admission.may_displace = False  # generate() feeds a full queue as it drains
        self._next_id = 0

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Union[PromptType, Sequence[PromptType]],
        sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
        *,
        priority: Optional[Sequence[int]] = None,
        lora_name: Union[str, Sequence[Optional[str]], None] = None,
        use_tqdm: UseTqdm = True,
    ) -> list[RequestOutput]:
        """Generate completions for one prompt or many (strings or token-id lists, or vLLM's dicts:
        ``{"prompt": text, "multi_modal_data": {"image": image or [images]}}``, or with
        ``"prompt_token_ids"``; each image a PIL image or its encoded bytes, docs/multimodal.md).

        ``lora_name``: one adapter for every prompt, or one per prompt (None: the base
        model); adapters come from ``LLM(enable_lora=True, lora_modules={name: folder})``
        or ``llm.engine.add_lora(name, folder)``. ``use_tqdm``: a progress bar of finished
        prompts on stderr (True), none (False), or a tqdm-like callable.

        Raises:
            ValueError: for an invalid prompt or parameters (nothing is left queued), an
                invalid ``use_tqdm``, or a guided-decoding format that does not compile
                (raised after the run).
        """
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if isinstance(sampling_params, SamplingParams) or sampling_params is None:
            # None: the model's sampling defaults (generation_config.json), as vLLM's LLM applies them.
            params_list = [sampling_params or SamplingParams.from_dict({})] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"sampling_params: got {len(params_list)} for {len(prompts)} prompts")
        priorities = list(priority) if priority is not None else [0] * len(prompts)
        loras = [lora_name] * len(prompts) if lora_name is None or isinstance(lora_name, str) else list(lora_name)
        if len(loras) != len(prompts):
            raise ValueError(f"lora_name: got {len(loras)} for {len(prompts)} prompts")
        progress = make_progress(len(prompts), use_tqdm)
        ids: list[str] = []
        final: dict[str, RequestOutput] = {}
        try:
            for prompt, params, prio, lora in zip(prompts, params_list, priorities, loras):
                request_id = str(self._next_id)
                self._next_id += 1
                # A full waiting queue (admission control) is fed as it drains: offline
                # batches of any size run, holding at most the queue's bound in memory.
                while not self._try_add(request_id, prompt, params, prio, lora):
                    self._step(final, progress)
                ids.append(request_id)
        except ValueError:
            progress.close()
            self.engine.abort_request(ids)
            while self.engine.has_unfinished_requests():
                self.engine.step()
            raise
        try:
            return self._run(ids, final, progress)
        finally:
            progress.close()

    def _try_add(self, request_id: str, prompt: PromptType, params: SamplingParams, priority: int,
                 lora_name: Optional[str]) -> bool:
        try:
            self.engine.add_request(request_id, prompt, params, priority=priority, lora_name=lora_name)
        except EngineOverloaded:
            return False
        return True

    def _step(self, final: dict[str, RequestOutput], progress: Union[Progress, NoProgress]) -> None:
        for out in self.engine.step():
            if out.finished:
                final[out.request_id] = out
                progress.finished(out)

    def chat(self, messages: list[dict], sampling_params: Optional[SamplingParams] = None,
             use_tqdm: UseTqdm = True) -> RequestOutput:
        """Generate a reply to one conversation using the tokenizer's chat template."""
        prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return self.generate(self.tokenizer.encode(prompt, add_special_tokens=False), sampling_params,
                             use_tqdm=use_tqdm)[0]

    def _run(self, ids: list[str], final: dict[str, RequestOutput],
             progress: Union[Progress, NoProgress]) -> list[RequestOutput]:
        while self.engine.has_unfinished_requests():
            self._step(final, progress)
        failed = [(i, final[request_id].error) for i, request_id in enumerate(ids) if final[request_id].error]
        if failed:  # e.g. a grammar that does not compile; the other prompts did run
            raise ValueError("; ".join(f"prompt {i}: {error}" for i, error in failed))
        return [final[i] for i in ids]
