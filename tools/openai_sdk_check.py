"""Manual check of Picchio's HTTP API with the official `openai` Python SDK (not run in CI).

Start a server on any model first, e.g. a random one with the real vocabulary:
    picchio synth --shape tiny /tmp/sdk-tiny
    picchio serve -m /tmp/sdk-tiny --http 127.0.0.1:8099 --device cpu --ctx 4096
then `pip install openai pydantic` and run this file. On a random model the text is noise;
what is checked is that every call succeeds and the shapes and constraints hold."""
import json
from openai import OpenAI
from pydantic import BaseModel

c = OpenAI(base_url="http://127.0.0.1:8099/v1", api_key="x")
out = {}

r = c.responses.create(model="m", input="Say hi", max_output_tokens=24)
out["responses.create"] = (r.status, [o.type for o in r.output], r.usage.output_tokens)

events = []
with c.responses.stream(model="m", input="Say hi", max_output_tokens=16) as s:
    for e in s:
        events.append(e.type)
    final = s.get_final_response()
out["responses.stream"] = (events[0], events[-1], len(events), final.status)

class Person(BaseModel):
    name: str
    age: int

p = c.chat.completions.parse(model="m", messages=[{"role": "user", "content": "A person"}],
                             response_format=Person, max_tokens=400, temperature=0)
msg = p.choices[0].message
out["chat.completions.parse"] = (p.choices[0].finish_reason, msg.parsed, msg.content)

tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
    "additionalProperties": False}, "strict": True}}]
t = c.chat.completions.create(model="m", messages=[{"role": "user", "content": "Weather?"}],
                              tools=tools, tool_choice="required", max_tokens=400, temperature=0)
tc = t.choices[0].message.tool_calls
out["tool_choice=required"] = (t.choices[0].finish_reason, tc and tc[0].function.name,
                               tc and json.loads(tc[0].function.arguments))

st = c.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                               max_tokens=20, logprobs=True, top_logprobs=2, stream=True,
                               stop=["e"])
chunks = list(st)
out["chat stream logprobs+stop"] = (chunks[-1].choices[0].finish_reason,
                                    sum(len(ch.choices[0].logprobs.content) for ch in chunks
                                        if ch.choices and ch.choices[0].logprobs))
comp = c.completions.create(model="m", prompt="Hello", max_tokens=5)
out["completions.create"] = (comp.choices[0].finish_reason, comp.usage.completion_tokens)
for k, v in out.items():
    print(f"{k}: {v}")
