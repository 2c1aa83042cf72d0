"""Time to the first token of a Home-Assistant-shaped conversation, turn after turn: ncm on 1
and on 3 agents (its prompt cache on, and off) next to llama.cpp (llama-cpp-python, which
keeps the KV cache of its last prompt and evaluates only what follows the common beginning:
llama-server's ``cache_prompt``), from one run.

    python bench/prompt_cache.py [--turns 10] [--threads 1] [--conversation home-assistant|chat]
                                 [--placement split|replicas|auto]

The conversation is what Home Assistant's Ollama integration sends with "Assist" on: its
instructions and the exposed devices in the system turn, five tools (described in the system
turn, as ncm does for the default model's template, which knows no tools), then short user
turns; ``--conversation chat`` is a plain chat (Open WebUI's chat page) whose first turn pastes
an article of about 1,800 tokens to summarise, so turn 2 reads about 1,900. Each turn is
answered (the answers in the history are fixed, so every side reads the same
prompts). Each turn is one request for one token: its time is the prefill of what the side
has not cached, and one sampling. Prints each turn's time per side and the ratios the issue
asks for: turn 2 / turn 1 per side (aim <= 0.2) and ncm / llama.cpp at turn 2 (aim <= 1.0).
The sides take turns on every conversation turn, so a busy moment of a shared machine does
not land on one of them alone. The agents split the model (the pipeline) unless ``--placement``
names another placement (design §11): with whole copies, each request runs on one copy.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.cluster import free_port, placed, serving  # noqa: E402 - after the path
from shards.importers.pull import PULLABLE, fetch_gguf  # noqa: E402
from shards.runtime.tool_calls import generic_system_text  # noqa: E402

INSTRUCTIONS = (
    "You are a voice assistant for Home Assistant.\nAnswer questions about the world truthfully.\n"
    "Answer in plain text. Keep it simple and to the point.\n"
    "When controlling Home Assistant always call the intent tools. Use HassTurnOn to lock and HassTurnOff to "
    "unlock a lock. When controlling a device, prefer passing just name and domain. When controlling an area, "
    "prefer passing just area name and domain.\nWhen a user asks to turn on all devices of a specific type, ask "
    "user to specify an area, unless there is only one device of that type.\nThis device is not able to start "
    "timers.\nYou ARE equipped to answer questions about the current state of the home using the `GetLiveContext` "
    "tool. This is a primary function. Do not state you lack the functionality if the question requires live "
    "data.\nIf the user asks about device existence/type (e.g., 'Do I have lights in the bedroom?'): Answer from "
    "the static context below.\nIf the user asks about the CURRENT state, value, or mode (e.g., 'Is the lock "
    "locked?', 'Is the fan on?', 'What mode is the thermostat in?', 'What is the temperature outside?'): 1. "
    "Recognize this requires live data. 2. You MUST call `GetLiveContext`. This tool will provide the needed "
    "real-time information (like temperature from the local weather, lock status, etc.). 3. Use the tool's "
    "response to answer the user accurately (e.g., 'The temperature outside is [value from tool].').\n"
    "For general knowledge questions not about the home: Answer truthfully from internal knowledge.\n"
    "Static Context: An overview of the areas and the devices in this smart home:\n"
    "- names: Kitchen light\n  domain: light\n  areas: Kitchen\n- names: Living room lamp\n  domain: light\n"
    "  areas: Living Room\n- names: Front door\n  domain: lock\n  areas: Hallway\n- names: Thermostat\n"
    "  domain: climate\n  areas: Living Room\n- names: Bedroom fan\n  domain: fan\n  areas: Bedroom\n")
_NAME_AREA = {"type": "object", "properties": {"name": {"type": "string"}, "area": {"type": "string"},
                                                "domain": {"type": "array", "items": {"type": "string"}}}}
TOOLS = [
    {"name": "HassTurnOn", "description": "Turns on/opens/presses a device or entity", "parameters": _NAME_AREA},
    {"name": "HassTurnOff", "description": "Turns off/closes a device or entity", "parameters": _NAME_AREA},
    {"name": "HassLightSet", "description": "Sets the brightness percentage or color of a light",
     "parameters": {"type": "object", "properties": {"name": {"type": "string"}, "area": {"type": "string"},
                                                     "brightness": {"type": "integer", "minimum": 0,
                                                                    "maximum": 100}}}},
    {"name": "HassClimateSetTemperature", "description": "Sets the desired temperature of a climate device",
     "parameters": {"type": "object", "properties": {"name": {"type": "string"},
                                                     "temperature": {"type": "number"}},
                    "required": ["temperature"]}},
    {"name": "GetLiveContext", "description": "Provides real-time information about the CURRENT state, value, or "
     "mode of devices, sensors, entities, or areas", "parameters": {"type": "object", "properties": {}}},
]
TURNS = [("Turn on the kitchen light.", '{"tool_calls": [{"name": "HassTurnOn", "arguments": {"name": "Kitchen light"}}]}'),
         ("Is the front door locked?", '{"tool_calls": [{"name": "GetLiveContext", "arguments": {}}]}'),
         ("Set the living room lamp to 40 percent.", '{"response": "The living room lamp is at 40 percent."}'),
         ("What is the temperature inside?", '{"response": "It is 21 degrees inside."}'),
         ("Turn off the bedroom fan.", '{"response": "The bedroom fan is off."}')]



def article(sentences: int = 75) -> str:
    """A made-up article of about 24 tokens a sentence, the same on every run."""
    things = ["the heat pump", "the garden sensors", "the hallway lights", "the solar inverter", "the old router",
              "the kitchen speaker", "the basement freezer", "the garage door", "the weather station"]
    doings = ["reported a steady reading", "dropped off the network twice", "used less power than last winter",
              "needed a firmware update", "woke up the family at night", "saved about a fifth of the bill",
              "kept its schedule through the storm", "lost its settings after a power cut"]
    whens = ["on Monday morning", "during the cold week", "after the holidays", "while everyone was away",
             "late in the evening", "before the inspection"]
    return " ".join(f"{things[i % 9].capitalize()} {doings[(3 * i + 1) % 8]} {whens[(5 * i + 2) % 6]}, "
                    f"according to note {i + 1} of the house log." for i in range(sentences))


CHAT_TURNS = [("Summarise this article for me:\n\n" + article(),
               "The house log says the devices mostly kept working: a few dropped off the network or lost their "
               "settings, and the heat pump and inverter saved power."),
              ("Which device caused the most trouble?", "The old router, which dropped off the network."),
              ("What should I fix first?", "Update the router's firmware, then check the freezer."),
              ("Thanks. Anything about the garage?", "The garage door kept its schedule through the storm."),
              ("Write that as a short list.", "- Router: update firmware\n- Freezer: check settings")]
CONVERSATIONS = {  # name: (system turn, turns)
    "home-assistant": (INSTRUCTIONS + "\n\n" + generic_system_text(TOOLS, parallel=True), TURNS),
    "chat": ("You are a helpful assistant.", CHAT_TURNS),
}


def conversation_prompts(gguf_path: Path, turns: int, conversation: str = "home-assistant") -> list[str]:
    """The prompt text of each turn (the default model's chat template)."""
    import gguf

    from shards.text.tokenizer import Tokenizer
    from shards.text.tokenizer_gguf import tokenizer_spec_from_gguf

    tokenizer = Tokenizer(tokenizer_spec_from_gguf(gguf.GGUFReader(gguf_path)))
    system, answered = CONVERSATIONS[conversation]
    messages, prompts = [{"role": "system", "content": system}], []
    for turn in range(turns):
        question, answer = answered[turn % len(answered)]
        messages.append({"role": "user", "content": question})
        prompts.append(tokenizer.apply_chat_template(messages))
        messages.append({"role": "assistant", "content": answer})
    return prompts


def ncm_first_token_s(port: int, prompt: str, cache: bool) -> tuple[float, int]:
    """Seconds to answer one token, and the prompt tokens read from the cache."""
    body = json.dumps({"prompt": prompt, "max_tokens": 1, "temperature": 0, "cache_prompt": cache}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    started = time.perf_counter()
    with urllib.request.urlopen(request, timeout=600) as response:
        answer = json.load(response)
    return time.perf_counter() - started, answer["usage"]["prompt_tokens_details"]["cached_tokens"]


def llama_worker(gguf_path: str, threads: int, prompts: multiprocessing.Queue, times: multiprocessing.Queue) -> None:
    """llama.cpp in a process of its own: one token per prompt, its time back."""
    import llama_cpp

    llm = llama_cpp.Llama(gguf_path, n_ctx=4096, n_batch=512, n_threads=threads, verbose=False)
    times.put(0.0)  # loaded
    while (prompt := prompts.get()) is not None:
        started = time.perf_counter()
        llm.create_completion(prompt, max_tokens=1, temperature=0)
        times.put(time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1, help="threads per agent, and llama.cpp's")
    parser.add_argument("--nodes", default="1,3")
    parser.add_argument("--conversation", choices=sorted(CONVERSATIONS), default="home-assistant")
    parser.add_argument("--placement", choices=["split", "replicas", "auto"],
                        help="how the model is placed (default: split, the pipeline)")
    args = parser.parse_args()
    sizes = [int(n) for n in args.nodes.split(",")]
    with tempfile.TemporaryDirectory(prefix="ncm-bench-") as tmp:
        gguf_path = fetch_gguf(PULLABLE["smollm2-135m"], Path(tmp), progress=False)
        prompts = conversation_prompts(gguf_path, args.turns, args.conversation)
        context = multiprocessing.get_context("spawn")
        to_llama, from_llama = context.Queue(), context.Queue()
        llama = context.Process(target=llama_worker, args=(str(gguf_path), args.threads, to_llama, from_llama))
        llama.start()
        from_llama.get(timeout=600)
        sides: dict[str, list[float]] = {}
        cached: dict[str, list[int]] = {}
        ports = {nodes: free_port() for nodes in sizes}
        with contextlib.ExitStack() as clusters:
            env = placed(clusters, "smollm2-135m", args.placement)
            for nodes in sizes:  # every cluster size serving side by side
                clusters.enter_context(serving(nodes, ports[nodes], args.threads, env=env))
            for turn, prompt in enumerate(prompts, 1):
                for nodes in sizes:
                    for cache in (True, False):
                        seconds, hit = ncm_first_token_s(ports[nodes], prompt, cache)
                        name = f"ncm {nodes} agent{'s' if nodes > 1 else ''}{'' if cache else ', no cache'}"
                        sides.setdefault(name, []).append(seconds)
                        cached.setdefault(name, []).append(hit)
                to_llama.put(prompt)
                sides.setdefault("llama.cpp", []).append(from_llama.get(timeout=600))
                print(f"turn {turn}: " + ", ".join(f"{name} {times[-1]:.3f} s" for name, times in sides.items()),
                      flush=True)
        to_llama.put(None)
        llama.join(timeout=30)
    print("\n| side | turn 1 | turn 2 | turn " + str(args.turns) + " | turn 2 / turn 1 | cached at turn 2 |")
    print("|---|---|---|---|---|---|")
    for name, times in sides.items():
        hit = cached.get(name, [0, 0])[1] if name in cached else "-"
        print(f"| {name} | {times[0]:.3f} s | {times[1]:.3f} s | {times[-1]:.3f} s | {times[1] / times[0]:.2f} | {hit} |")
    for nodes in sizes:
        name = f"ncm {nodes} agent{'s' if nodes > 1 else ''}"
        print(f"{name} / llama.cpp at turn 2: {sides[name][1] / sides['llama.cpp'][1]:.2f}; at turn {args.turns}: "
              f"{sides[name][-1] / sides['llama.cpp'][-1]:.2f}")


if __name__ == "__main__":
    main()
