"""The OpenAI-compatible HTTP endpoint of `ddctl serve`, driven by the stock `openai` Python client
and by curl: models, completions and chat completions, streamed and not, the same text as the gRPC
API, errors in the API's shape, API keys enforced, oversized bodies refused; and what stock clients
and load generators rely on: /health, content as a list of text parts, stream_options.include_usage,
and every request field of the API honoured or refused by name (docs/api.md)."""
import json
import subprocess
import urllib.error
import urllib.request

import openai
import pytest

from serving import Proc, ddctl, ddctl_json, require_model, wait_for

KEY = "k" * 40


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    require_model()
    d = tmp_path_factory.mktemp("openai")
    keys = d / "keys.json"
    keys.write_text(json.dumps([{"tenant": "team-a", "key": KEY}]))
    keys.chmod(0o600)
    p = Proc("serve", ["ddctl", "serve", "--model=smollm2", "--http_listen=127.0.0.1:0", f"--api_keys_file={keys}",
                       "--threads=1"], d)
    key_file = d / "key"
    key_file.write_text(KEY + "\n")
    key_file.chmod(0o600)
    try:
        assert p.http, "no http address in the listening line"
        yield {"proc": p, "http": f"http://{p.http}/v1", "key_file": str(key_file)}
    finally:
        p.stop()


def client(server, key=KEY):
    return openai.OpenAI(base_url=server["http"], api_key=key, max_retries=0, timeout=120)


def test_models_lists_the_served_model(server):
    models = client(server).models.list()
    assert [m.id for m in models.data] != [] and all(m.object == "model" for m in models.data)


def test_completion_matches_the_grpc_api_streamed_or_not(server):
    c = client(server)
    prompt = "The three primary colors are"
    out = c.completions.create(model="", prompt=prompt, max_tokens=8, temperature=0)
    text = out.choices[0].text
    assert out.object == "text_completion" and out.usage.completion_tokens == 8
    assert out.choices[0].finish_reason == "length"
    grpc_out = ddctl_json("generate", "--server", server["proc"].addr, "--prompt", prompt, "--max_new_tokens", "8",
                          f"--api_key_file={server['key_file']}")
    assert text == grpc_out["text"], (text, grpc_out["text"])
    chunks = list(c.completions.create(prompt=prompt, max_tokens=8, temperature=0, stream=True, model=""))
    assert "".join(ch.choices[0].text for ch in chunks) == text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_uses_the_models_template_streamed_or_not(server):
    c = client(server)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    out = c.chat.completions.create(model="", messages=messages, max_tokens=12, temperature=0)
    answer = out.choices[0].message.content
    assert out.object == "chat.completion" and out.choices[0].message.role == "assistant"
    assert answer, out
    grpc_out = ddctl_json("generate", "--server", server["proc"].addr, "--chat", "--prompt", messages[0]["content"],
                          "--max_new_tokens", "12", f"--api_key_file={server['key_file']}")
    assert answer == grpc_out["text"]
    chunks = list(c.chat.completions.create(model="", messages=messages, max_tokens=12, temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == answer


def test_errors_have_the_api_shape_and_status(server):
    c = client(server)
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="", prompt="Hi", max_tokens=0)
    assert "max_new_tokens" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="", messages=[{"role": "tool", "content": "x"}], max_tokens=2)
    assert "messages[0].role" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="", prompt="Hi", max_tokens=2, n=2)
    assert "n: is not supported (only 1)" in str(e.value)
    with pytest.raises(openai.AuthenticationError):
        client(server, key="wrong-" + "x" * 40).completions.create(model="", prompt="Hi", max_tokens=2)
    # curl: no key at all, then malformed JSON, an unknown endpoint and an oversized body.
    base = server["http"]
    r = subprocess.run(["curl", "-s", "-w", "\n%{http_code}", "-X", "POST", f"{base}/completions", "-d",
                        '{"prompt": "Hi", "max_tokens": 2}'], capture_output=True, text=True, timeout=60)
    body, code = r.stdout.rsplit("\n", 1)
    assert code == "401" and json.loads(body)["error"]["type"] == "authentication_error", r.stdout
    auth = ["-H", f"Authorization: Bearer {KEY}"]
    r = subprocess.run(["curl", "-s", "-w", "\n%{http_code}", *auth, "-X", "POST", f"{base}/completions", "-d", "{nope"],
                       capture_output=True, text=True, timeout=60)
    body, code = r.stdout.rsplit("\n", 1)
    assert code == "400" and json.loads(body)["error"]["code"] == "invalid_json", r.stdout
    r = subprocess.run(["curl", "-s", "-w", "\n%{http_code}", *auth, f"{base}/embeddings"], capture_output=True, text=True,
                       timeout=60)
    assert r.stdout.rsplit("\n", 1)[1] == "404", r.stdout
    req = urllib.request.Request(f"{base}/completions", data=b"x" * (9 << 20), method="POST",
                                 headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=60)
    assert e.value.code == 413


def test_chat_without_a_length_runs_to_the_end_of_the_turn_not_16_tokens(server):
    out = client(server).chat.completions.create(
        model="", messages=[{"role": "user", "content": "Write a long story about a dragon and a knight."}],
        temperature=0)
    # The gRPC default (128) or the model's end of turn, never the completions API's 16.
    assert out.usage.completion_tokens == 128 or out.choices[0].finish_reason == "stop", out.usage


def test_health_answers_without_a_key_as_vllm_and_llama_server_do(server):
    base = server["http"].removesuffix("/v1")
    for path in ("/health", "/v1/health"):
        with urllib.request.urlopen(base + path, timeout=30) as r:
            assert r.status == 200 and json.loads(r.read())["status"] == "ok", path
    # Only GET: the key is still required for everything else.
    req = urllib.request.Request(base + "/v1/models")
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=30)
    assert e.value.code == 401


def test_content_as_a_list_of_text_parts_is_the_same_prompt(server):
    c = client(server)
    as_string = c.chat.completions.create(
        model="", messages=[{"role": "user", "content": "Name a color.\nAnswer in one word."}], max_tokens=6,
        temperature=0)
    as_parts = c.chat.completions.create(
        model="", messages=[{"role": "user", "content": [{"type": "text", "text": "Name a color."},
                                                         {"type": "text", "text": "Answer in one word."}]}],
        max_tokens=6, temperature=0)
    assert as_parts.choices[0].message.content == as_string.choices[0].message.content
    assert as_parts.usage.prompt_tokens == as_string.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="", max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "text", "text": "What is this?"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}])
    assert "messages[0].content[1].type: 'image_url' is not supported (only text parts)" in str(e.value)


def test_include_usage_ends_the_stream_with_a_usage_chunk(server):
    c = client(server)
    for chat in (False, True):
        kwargs = dict(model="", max_tokens=7, temperature=0, stream=True, stream_options={"include_usage": True})
        if chat:
            chunks = list(c.chat.completions.create(messages=[{"role": "user", "content": "Count: one,"}], **kwargs))
            text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        else:
            chunks = list(c.completions.create(prompt="Count: one,", **kwargs))
            text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
        last = chunks[-1]
        assert last.choices == [] and last.usage is not None, last
        assert last.usage.completion_tokens == 7, last.usage
        assert last.usage.total_tokens == last.usage.prompt_tokens + 7
        assert all(ch.usage is None for ch in chunks[:-1])
        assert text, chunks
    # Without include_usage no chunk carries usage; stream_options without stream is refused.
    chunks = list(c.completions.create(model="", prompt="Hi", max_tokens=3, temperature=0, stream=True))
    assert all(getattr(ch, "usage", None) is None for ch in chunks)
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="", prompt="Hi", max_tokens=2, stream_options={"include_usage": True})
    assert "stream_options: only allowed with" in str(e.value)


# Fields of the API the server does not implement: each refused by name when set, accepted at its
# default (docs/api.md, "Request fields").
REFUSED = [("logit_bias", {"42": 5}, {}),
           ("logprobs", True, False), ("top_logprobs", 2, None), ("store", True, False), ("n", 3, 1),
           ("tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}], []),
           ("tool_choice", "auto", "none"), ("response_format", {"type": "json_object"}, {"type": "text"}),
           ("modalities", ["text", "audio"], ["text"]), ("audio", {"voice": "alloy", "format": "wav"}, None),
           ("prediction", {"type": "content", "content": "x"}, None), ("reasoning_effort", "low", None)]


def test_every_unimplemented_field_is_refused_by_name_and_accepted_at_its_default(server):
    c = client(server)
    messages = [{"role": "user", "content": "Hi"}]
    for field, value, default in REFUSED:
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model="", messages=messages, max_tokens=2, extra_body={field: value})
        assert f"{field}: is not supported" in str(e.value), (field, str(e.value))
        if default is not None:
            out = c.chat.completions.create(model="", messages=messages, max_tokens=2, extra_body={field: default})
            assert out.usage.completion_tokens >= 1, field
    for field, value in (("best_of", 2), ("echo", True), ("suffix", "end")):
        with pytest.raises(openai.BadRequestError) as e:
            c.completions.create(model="", prompt="Hi", max_tokens=2, extra_body={field: value})
        assert f"{field}: is not supported" in str(e.value), (field, str(e.value))
    # Honoured: user and metadata change nothing; top_k=1 samples the greedy token, and so does
    # min_p=1; penalties change a greedy continuation that repeats itself; out of range: 400.
    greedy = c.completions.create(model="", prompt="The sky is", max_tokens=6, temperature=0).choices[0].text
    top1 = c.completions.create(model="", prompt="The sky is", max_tokens=6, temperature=1.0, seed=7, user="u-1",
                                extra_body={"top_k": 1, "metadata": {"k": "v"}}).choices[0].text
    assert top1 == greedy
    minp1 = c.completions.create(model="", prompt="The sky is", max_tokens=6, temperature=1.0, seed=8,
                                 extra_body={"min_p": 1.0}).choices[0].text
    assert minp1 == greedy
    repeat = "one two one two one two one two one two"
    plain = c.completions.create(model="", prompt=repeat, max_tokens=8, temperature=0).choices[0].text
    for kwargs in ({"frequency_penalty": 2.0}, {"presence_penalty": 2.0}, {"extra_body": {"repetition_penalty": 3.0}}):
        assert c.completions.create(model="", prompt=repeat, max_tokens=8, temperature=0, **kwargs).choices[0].text != plain
    for field, value in (("frequency_penalty", 2.5), ("presence_penalty", -3), ("repetition_penalty", 0),
                         ("min_p", 1.5), ("ignore_eos", "yes")):
        with pytest.raises(openai.BadRequestError) as e:
            c.completions.create(model="", prompt="Hi", max_tokens=2, extra_body={field: value})
        assert f"{field}: must be" in str(e.value), (field, str(e.value))


def test_curl_completion(server):
    r = subprocess.run(["curl", "-s", "-H", f"Authorization: Bearer {KEY}", "-H", "Content-Type: application/json",
                        "-d", '{"prompt": "Once upon a time", "max_tokens": 4, "temperature": 0}',
                        f"{server['http']}/completions"], capture_output=True, text=True, timeout=120)
    out = json.loads(r.stdout)
    assert out["usage"]["completion_tokens"] == 4 and out["choices"][0]["text"], out


def _http(addr, method, path, headers):
    import http.client
    host, port = addr.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        conn.request(method, path, headers=headers)
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read().decode()
    finally:
        conn.close()


def test_browsers_and_rebound_host_names_are_refused(tmp_path, server):
    """No CORS unless allowed: a request with an Origin header not on --http_cors_origins gets 403
    and no Access-Control-Allow-Origin, preflight included; an allowed origin gets its own name
    back. Without API keys only IP or localhost Host names are answered (a DNS-rebinding page
    uses its own name); with keys any name is."""
    p = Proc("serve-open", ["ddctl", "serve", "--model=smollm2", "--http_listen=127.0.0.1:0", "--threads=1",
                            "--http_cors_origins=https://app.example"], tmp_path)
    try:
        status, h, _ = _http(p.http, "GET", "/v1/models", {})
        assert status == 200 and "access-control-allow-origin" not in h, h
        status, h, body = _http(p.http, "GET", "/v1/models", {"Origin": "https://evil.example"})
        assert status == 403 and "origin_not_allowed" in body and "access-control-allow-origin" not in h, (h, body)
        pre = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"}
        status, h, _ = _http(p.http, "OPTIONS", "/v1/completions", {"Origin": "https://evil.example", **pre})
        assert status == 403 and "access-control-allow-origin" not in h, h
        status, h, _ = _http(p.http, "OPTIONS", "/v1/completions", {"Origin": "https://app.example", **pre})
        assert status == 204 and h.get("access-control-allow-origin") == "https://app.example", h
        assert "POST" in h.get("access-control-allow-methods", ""), h
        status, h, _ = _http(p.http, "GET", "/v1/models", {"Origin": "https://app.example"})
        assert status == 200 and h.get("access-control-allow-origin") == "https://app.example", h
        status, h, body = _http(p.http, "GET", "/v1/models", {"Host": "rebound.example:8080"})
        assert status == 403 and "host_not_allowed" in body, body
        for name in ("localhost", "127.0.0.1:1", "[::1]:80"):
            assert _http(p.http, "GET", "/v1/models", {"Host": name})[0] == 200, name
    finally:
        p.stop()
    keyed = server["http"].split("/")[2]
    status, _, _ = _http(keyed, "GET", "/v1/models", {"Host": "dd-router.dualdecoder.svc", "Authorization": f"Bearer {KEY}"})
    assert status == 200


def sse(server, body, headers, stop_after=None):
    """POSTs a streamed completion; returns [(event id, text delta)] read (all, or `stop_after`
    events before hanging up)."""
    import http.client
    from urllib.parse import urlparse
    u = urlparse(server["http"])
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=120)
    conn.request("POST", "/v1/completions", json.dumps(body),
                 {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json", **headers})
    r = conn.getresponse()
    assert r.status == 200, r.read()
    events, event_id = [], None
    for raw in r:
        line = raw.decode().rstrip("\n")
        if line.startswith("id: "):
            event_id = line[4:]
        elif line.startswith("data: ") and line != "data: [DONE]":
            choices = json.loads(line[6:]).get("choices") or [{}]
            events.append((event_id, choices[0].get("text", "")))
            event_id = None
            if stop_after is not None and len(events) >= stop_after:
                break
    conn.close()  # a hang-up mid-stream when stop_after cut it short
    return events


def test_a_named_sse_stream_resumes_after_a_dropped_connection_with_last_event_id(server):
    body = {"model": "", "prompt": "The history of the old mill by the river:", "max_tokens": 48,
            "temperature": 0, "stream": True}
    want = "".join(t for _, t in sse(server, body, {}))
    first = sse(server, body, {"X-Stream-Id": "sse-story-1"}, stop_after=6)
    last_id = [i for i, _ in first if i][-1]
    assert last_id.startswith("sse-story-1.") and int(last_id.split(".")[-1]) > 0, first
    assert all(i is not None for i, _ in first), first  # every event of a named stream has an id
    rest = sse(server, body, {"Last-Event-ID": last_id})
    assert "".join(t for _, t in first) + "".join(t for _, t in rest) == want
    # An id the server does not keep (a guess, or long gone) is refused by name.
    with pytest.raises(urllib.error.HTTPError) as e:
        req = urllib.request.Request(server["http"] + "/completions", json.dumps(body).encode(),
                                     {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json",
                                      "Last-Event-ID": "nobody.3"})
        urllib.request.urlopen(req, timeout=60)
    assert e.value.code == 404, e.value.read()
