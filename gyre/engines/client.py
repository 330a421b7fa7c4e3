"""One async HTTP client for both rollout servers (builtin `gyre-engine` and SGLang 0.5.x).

Every call has an explicit timeout; a non-2xx answer raises EngineHTTPError carrying the status
and the response body. With `key_by_weight_version` (SGLang engines), `generate` sends
`extra_key` = `weight_version`, the version the engine serves now as its owner set it (the proxy's
admin API, told by the coordinator after each load; not what the last answer said, which lags an
update by one call), so SGLang's HiCache never mixes KV across weight versions. Weight versions
are integers (the optimizer step) on Gyre's side; on the wire they are what the engine sends
(SGLang: strings).
"""

import asyncio
from collections.abc import AsyncIterator, Sequence

import aiohttp

from gyre.common import jsonio
from gyre.errors import GyreError
from gyre.records.versions import VersionSpan, parse_weight_version

KEEPALIVE_S = 4.0
"""How long an idle pooled connection is kept: under the 5 s after which uvicorn (SGLang's server)
closes one, so a request never races the server closing the connection it was sent on (a
/generate is a POST, which aiohttp does not retry)."""
REST_OF_STREAM_S = 5.0
"""How long to wait for the end of a /generate stream after its finish chunk (it follows at once);
past it the call goes on and the connection is closed instead of pooled."""


class EngineHTTPError(GyreError):
    def __init__(self, status: int, path: str, body: str):
        self.status, self.path, self.body = status, path, body
        super().__init__(f"{path} -> HTTP {status}: {body[:500]}")


class EngineStreamError(EngineHTTPError):
    """An error the engine reported inside a /generate stream it answered with HTTP 200 (SGLang
    0.5.21, `srt/entrypoints/http_server.py` `generate_request`: `data: {"error": {"message",
    "code", ...}}` then `data: [DONE]`): the HTTP error it stands for, `status` its `code`."""

    def __init__(self, error: dict):
        code = error.get("code")
        status = code if isinstance(code, int) and 400 <= code < 600 else 500
        super().__init__(status, "/generate", str(error.get("message", error)))


class EngineClient:
    """Use as `async with EngineClient(url) as c:`; one aiohttp session per client."""

    def __init__(self, base_url: str, timeout_s: float = 600.0, key_by_weight_version: bool = False):
        self.base_url = base_url.rstrip("/")
        self.key_by_weight_version = key_by_weight_version
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.weight_version: int | None = None
        """The engine's weight version (an int: the trainer's step): set by its loads and, unless
        `key_by_weight_version` (then only its owner sets it), learnt from its answers."""
        self._loaded = asyncio.Event()
        self._loaded.set()
        self._session: aiohttp.ClientSession | None = None

    def hold_calls(self) -> None:
        """A weight load is starting: keyed calls wait (`serve_version` releases them), so none
        leaves with a version the engine no longer serves once the load lands."""
        self._loaded.clear()

    def serve_version(self, version: int) -> None:
        """The engine serves `version` now: keyed calls carry it from here on."""
        self.weight_version = version
        self._loaded.set()

    async def __aenter__(self) -> "EngineClient":
        self._session = aiohttp.ClientSession(
            timeout=self.timeout, connector=aiohttp.TCPConnector(keepalive_timeout=KEEPALIVE_S)
        )
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _request(self, method: str, path: str, body: dict | None = None, raw: bytes | None = None):
        if self._session is None:
            raise GyreError("EngineClient used outside `async with`")
        data = raw if raw is not None else (None if body is None else jsonio.dumpb(body))  # 131K ids: ~6x faster
        headers = {"Content-Type": "application/json"} if data is not None else None
        async with self._session.request(method, self.base_url + path, data=data, headers=headers) as r:
            text = await r.text()
            if r.status >= 300:
                raise EngineHTTPError(r.status, path, text)
            try:
                return jsonio.loads(text)
            except jsonio.DecodeError:
                return text

    async def post(self, path: str, body: dict | None = None):
        return await self._request("POST", path, body if body is not None else {})

    async def get(self, path: str):
        return await self._request("GET", path)

    # --- generation ---------------------------------------------------------------------------
    def _generate_body(self, input_ids, sampling_params, rid, return_logprob, stream, extra_key) -> dict:
        body = {
            "input_ids": list(input_ids),
            "sampling_params": dict(sampling_params or {}),
            "return_logprob": return_logprob,
            "stream": stream,
        }
        if rid is not None:
            body["rid"] = rid
        key = extra_key if extra_key is not None or not self.key_by_weight_version else _wire(self.weight_version)
        if key is not None:
            body["extra_key"] = str(key)  # SGLang's GenerateReqInput.extra_key is a string
        return body

    def _generate_payload(
        self, input_ids, sampling_params, rid, return_logprob, stream, extra_key, input_ids_json
    ) -> bytes:
        """The /generate body as JSON; `input_ids_json` (input_ids already as a JSON array, whole or
        in pieces) is spliced in as is."""
        if input_ids_json is None:
            return jsonio.dumpb(self._generate_body(input_ids, sampling_params, rid, return_logprob, stream, extra_key))
        rest = self._generate_body((), sampling_params, rid, return_logprob, stream, extra_key)
        del rest["input_ids"]
        pieces = (input_ids_json,) if isinstance(input_ids_json, bytes) else input_ids_json
        return b"".join((b'{"input_ids":', *pieces, b",", jsonio.dumpb(rest)[1:]))  # one copy

    async def generate(
        self,
        input_ids,
        sampling_params=None,
        *,
        rid=None,
        return_logprob=True,
        extra_key=None,
        input_ids_json: bytes | tuple[bytes, ...] | None = None,
    ) -> dict:
        """One /generate answer.

        input_ids_json: `input_ids` already encoded (the proxy keeps each prompt's JSON), sent as is.
        """
        if self.key_by_weight_version:
            await self._loaded.wait()
        payload = self._generate_payload(
            input_ids, sampling_params, rid, return_logprob, False, extra_key, input_ids_json
        )
        out = await self._request("POST", "/generate", raw=payload)
        self._saw(out["meta_info"])
        return out

    async def generate_stream(
        self,
        input_ids,
        sampling_params=None,
        *,
        rid=None,
        return_logprob=True,
        extra_key=None,
        input_ids_json: bytes | tuple[bytes, ...] | None = None,
    ) -> AsyncIterator[dict]:
        """Yield each SSE chunk (cumulative output, SGLang's default) until `data: [DONE]`; an error
        chunk raises EngineStreamError.

        The chunk with a `finish_reason` is the last one (SGLang's and the builtin engine's): the
        rest of the body (`data: [DONE]`) is read before it is yielded, so a caller that stops there
        leaves the connection at its end and aiohttp pools it (an unread body closes it: one more
        TCP connect and close per call)."""
        if self.key_by_weight_version:
            await self._loaded.wait()
        payload = self._generate_payload(
            input_ids, sampling_params, rid, return_logprob, True, extra_key, input_ids_json
        )
        async with self._session.post(
            self.base_url + "/generate", data=payload, headers={"Content-Type": "application/json"}
        ) as r:
            if r.status >= 300:
                raise EngineHTTPError(r.status, "/generate", await r.text())
            async for line in r.content:
                line = line.strip()
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    return
                chunk = jsonio.loads(payload)
                if "error" in chunk:
                    raise EngineStreamError(chunk["error"] if isinstance(chunk["error"], dict) else {})
                meta = chunk.get("meta_info", {})
                self._saw(meta)
                if meta.get("finish_reason"):
                    try:
                        async with asyncio.timeout(REST_OF_STREAM_S):
                            await r.content.read()
                    except TimeoutError:
                        pass
                yield chunk

    def _saw(self, meta: dict) -> None:
        if not self.key_by_weight_version:
            self.weight_version = _version(meta.get("weight_version"), self.weight_version)

    async def abort(self, rid: str | None = None, abort_all: bool = False) -> dict:
        return await self.post("/abort_request", {"rid": rid or "", "abort_all": abort_all})

    async def pause(self, mode: str = "abort") -> dict:
        """/pause_generation {mode} (SGLang 0.5.21 `PauseGenerationReqInput`): abort ends every call
        (finish abort, partial output); retract and in_place keep them for /continue_generation,
        retract without their KV (recomputed then), in_place with it (an update must then not flush
        the cache: SGLang's server dies on it). New calls wait until `resume`."""
        return await self.post("/pause_generation", {"mode": mode})

    async def resume(self, torch_empty_cache: bool = True) -> dict:
        """/continue_generation {torch_empty_cache} (SGLang 0.5.21 `ContinueGenerationReqInput`)."""
        return await self.post("/continue_generation", {"torch_empty_cache": torch_empty_cache})

    # --- weights, memory, cache ---------------------------------------------------------------
    async def update_weights_from_disk(self, model_path: str, weight_version: int | None = None, **extra) -> dict:
        out = await self.post(
            "/update_weights_from_disk", {"model_path": model_path, "weight_version": _wire(weight_version), **extra}
        )
        self.weight_version = _version(out.get("weight_version"), weight_version)
        return out

    async def update_weights_from_tensor(self, weight_version: int | None = None, **payload) -> dict:
        out = await self.post("/update_weights_from_tensor", {"weight_version": _wire(weight_version), **payload})
        self.weight_version = _version(out.get("weight_version"), weight_version)
        return out

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = "gyre",
        backend: str = "nccl",
    ) -> dict:
        """SGLang only: join the trainer's NCCL group for /update_weights_from_distributed."""
        return await self.post(
            "/init_weights_update_group",
            {
                "master_address": master_address,
                "master_port": master_port,
                "rank_offset": rank_offset,
                "world_size": world_size,
                "group_name": group_name,
                "backend": backend,
            },
        )

    async def begin_weight_update(self, selector: str = "all") -> dict:
        """SGLang 0.5.21: open the weight-update session that /update_weights_from_distributed and
        /update_weights_from_tensor must run in (`BeginWeightUpdateReqInput`); like them it waits
        for every call in flight unless generation is paused."""
        return await self.post("/begin_weight_update", {"selector": selector})

    async def end_weight_update(self) -> dict:
        """SGLang 0.5.21: close the session `begin_weight_update` opened."""
        return await self.post("/end_weight_update", {})

    async def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        weight_version: int | None = None,
        group_name: str = "gyre",
        flush_cache: bool = True,
    ) -> dict:
        """SGLang only: receive these tensors by NCCL broadcast from the trainer's rank 0.

        flush_cache: False while an in_place pause holds calls: SGLang's server dies flushing a
        cache that running calls use (0.5.21 `weight_updater.py` asserts the flush succeeded).
        """
        out = await self.post(
            "/update_weights_from_distributed",
            {
                "names": names,
                "dtypes": dtypes,
                "shapes": shapes,
                "group_name": group_name,
                "weight_version": _wire(weight_version),
                "flush_cache": flush_cache,
            },
        )
        self.weight_version = self.weight_version if weight_version is None else weight_version
        return out

    async def flush_cache(self) -> dict:
        return await self.post("/flush_cache", {})

    async def release_memory(self, tags: list[str] | None = None) -> dict:
        return await self.post("/release_memory_occupation", {"tags": tags})

    async def resume_memory(self, tags: list[str] | None = None) -> dict:
        return await self.post("/resume_memory_occupation", {"tags": tags})

    # --- status -------------------------------------------------------------------------------
    async def health(self) -> bool:
        try:
            await self.get("/health")
            return True
        except (EngineHTTPError, aiohttp.ClientError, TimeoutError):
            return False

    async def health_generate(self) -> None:
        await self.get("/health_generate")

    async def model_info(self) -> dict:
        info = await self.get("/get_model_info")  # SGLang 0.5.x has no /model_info
        self.weight_version = _version(info.get("weight_version"), self.weight_version)
        return info

    async def loads(self) -> dict:
        return await self.get("/v1/loads")

    # --- KV migration (builtin engines only) --------------------------------------------------
    async def export_kv(self, sessions: list[tuple[Sequence[int], int]], extra_key: str | None = None) -> dict:
        """Publish the cached KV of sessions' prefixes: each (input ids, a list or an int array
        written as it is, kv_from: tokens the importer holds already, skipped)."""
        asks = [{"input_ids": ids, "kv_from": kv_from} for ids, kv_from in sessions]
        return await self.post("/gyre/export_kv", {"sessions": asks, "extra_key": extra_key})

    async def import_kv(self, export: dict, extra_key: str | None = None) -> dict:
        """`export`: a peer's export_kv answer, as it came (its token ids travel in the read)."""
        return await self.post("/gyre/import_kv", {**export, "extra_key": extra_key})

    async def release_kv_export(self, export_id: str) -> dict:
        return await self.post("/gyre/release_kv_export", {"export_id": export_id})


async def migrate_prefixes(
    src: EngineClient, dst: EngineClient, sessions: list[tuple[Sequence[int], int]], extra_key: str | None = None
) -> list[dict]:
    """Move the KV of sessions' cached prefixes from `src` to `dst` over Mooncake: one export, one
    import (one batch read), one release, whatever their number.

    Args:
        sessions: each (input ids, kv_from): `dst` holds the KV of its first kv_from tokens
            already (an earlier move; page-aligned), only the rest moves.
    Returns: per session {"exported_tokens", "transferred_tokens", "recomputed_tokens", "refused"}:
    the page-aligned prefix `src` held beyond kv_from, the part of it `dst` got, the rest beyond
    kv_from that `dst` must compute itself, and why `dst` refused it (a 4xx for all: other weights;
    or its own: no room), else None. (A /generate on exactly the ids still recomputes its last
    page: the next token needs one forward.)
    """
    export = await src.export_kv(sessions, extra_key)
    held = [max(0, int(e["num_tokens"]) - int(e["kv_from"])) for e in export["sessions"]]
    results = [{"transferred_tokens": 0, "refused": None} for _ in held]
    try:
        if any(held):
            results = (await dst.import_kv(export, extra_key))["sessions"]
    except EngineHTTPError as e:
        if e.status >= 500:
            raise
        results = [{"transferred_tokens": 0, "refused": e.body[:500]} for _ in held]
    finally:
        await src.release_kv_export(export["export_id"])
    return [
        {"exported_tokens": h, **r, "recomputed_tokens": len(ids) - kv_from - r["transferred_tokens"]}
        for h, r, (ids, kv_from) in zip(held, results, sessions)
    ]


def parse_version_spans(meta: dict) -> list[VersionSpan] | None:
    """The weight versions over a /generate answer's output tokens, where it says: the builtin
    engine's `weight_version_spans` ({weight_version, start, end}, every chunk) or SGLang's
    `weight_versions` ({version, start, end}, the final chunk; SGLang 0.5.21
    `srt/utils/weight_versions.py`); None where it has neither. SGLang's empty span (a call with no
    output) is dropped.

    Raises:
        WeightVersionError, KeyError, TypeError, ValueError: a malformed span.
    """
    if meta.get("weight_version_spans"):
        return [VersionSpan.from_wire(s) for s in meta["weight_version_spans"]]
    if meta.get("weight_versions"):
        spans = [
            VersionSpan(int(s["start"]), int(s["end"]), parse_weight_version(s["version"]))
            for s in meta["weight_versions"]
        ]
        return [s for s in spans if s.end > s.start]
    return None


def _wire(version: int | None) -> str | None:
    """A version as the engines' HTTP APIs take it (SGLang declares it a string; the builtin engine parses both)."""
    return None if version is None else str(version)


def _version(reported: object, default: int | None) -> int | None:
    """The integer version an engine reported (SGLang reports strings), else `default`."""
    return default if reported is None else parse_weight_version(reported)
