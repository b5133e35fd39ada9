"""The embedded default model: a tiny random Qwen3 with a real byte-level BPE tokenizer, both built
here from nothing, so demos, tests and CI run with no download.

The tokenizer is trained with `tokenizers` on the small corpus below. Byte-level pre-tokenization
and decoding mean any UTF-8 text round-trips, whatever the corpus saw: characters it lacks become
their bytes. Vocabulary: 3 special tokens, the 256 byte symbols, then 253 merges: 512 in all.
"""

from __future__ import annotations

import functools
import json
import os

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

VOCAB_SIZE = 512
ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END]  # ids 0, 1, 2, in this order
EOS_TOKEN_ID, PAD_TOKEN_ID = 2, 0
# A directory holding all of these is a finished demo checkpoint.
_CHECKPOINT_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")

# ChatML as Qwen writes it, without a default system message; tools as Qwen's templates render
# them (a system turn listing them in <tools>, an assistant's calls as <tool_call> blocks, their
# results in `tool` turns).
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n# Tools\\n<tools>\\n' }}"
    "{%- for tool in tools %}{{- tool | tojson }}{{- '\\n' }}{%- endfor %}"
    "{{- '</tools>\\nCall a function with <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] }}"
    "{%- for call in message.get('tool_calls') or [] %}"
    "{{- '<tool_call>\\n{\"name\": \"' + call['function']['name'] + '\", \"arguments\": ' }}"
    "{{- call['function']['arguments'] | tojson }}{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

CORPUS = """\
The server sleeps when the trainer needs the graphics card. It gives back the memory that holds the
weights, the cache of keys and values, and the captured graphs, then waits for a message that says
it may wake up again. When it wakes, nothing has moved: every address is where it was before, so the
graphs replay at once and the first request after the nap is as fast as the last one before it.

A request arrives as a prompt and a set of sampling parameters. The scheduler puts it in a queue,
gives it blocks of cache as they are needed, and lets it run next to many others in one batch. Each
step computes one new token for every running sequence; a long prompt is cut into chunks so that
short requests never wait behind it for long. When the cache is full, the youngest request steps
aside and comes back later, recomputing what it lost.

Sampling turns a row of scores into one token. With a temperature of zero the best token always
wins. Otherwise the scores are divided by the temperature, the unlikely tail is cut away by top-k,
top-p or min-p, and a token is drawn at random. A request that names a seed gets the same tokens
every time, whatever else is running beside it.

Tokens become text a little at a time. One character may take several tokens, and a stop string
may arrive in pieces, so the text is held back until it is certain. Good morning! How are you
today? I would like a cup of tea, two slices of bread, and the weather report for Tuesday, please.
Numbers too: 0 1 2 3 4 5 6 7 8 9, 10, 42, 100, 2048, 3.14159 and 1,000,000.

Bonjour, ça va très bien, merci. Où est la gare ? Grüße aus München, schöne Straße. ¿Dónde está
la biblioteca? Mañana será otro día. Ελληνικά: καλημέρα κόσμε. Русский: привет, мир.
中文：你好，世界。我们今天学习机器学习和自然语言处理。模型很小，但是分词器是真的。
日本語：こんにちは、世界。今日はいい天気ですね。한국어: 안녕하세요 세계.
Emoji: 😀 😂 🎉 🚀 ❤️ 👍 🌍 ✨ 🤖 — and symbols: → ← ★ ∑ ∞ € £ ¥ © ®.
"""


@functools.lru_cache(maxsize=1)
def build_tokenizer() -> PreTrainedTokenizerFast:
    """The demo tokenizer; the same on every call and every machine (training is deterministic)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes, seen or not
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS.splitlines(), trainer=trainer)
    if tokenizer.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(
            f"demo tokenizer has {tokenizer.get_vocab_size()} tokens, not {VOCAB_SIZE}"
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        extra_special_tokens=[IM_START],
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,  # decode must concatenate, for incremental decoding
        model_max_length=2048,
    )


def save_tokenizer(path: str) -> None:
    """Write tokenizer.json and tokenizer_config.json (chat template inside) to `path`."""
    build_tokenizer().save_pretrained(path, save_jinja_files=False)
    # transformers 5 names its own backend class; name the class every 4.x and 5.x release loads.
    config_file = os.path.join(path, "tokenizer_config.json")
    with open(config_file) as f:
        config = json.load(f)
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    with open(config_file, "w") as f:
        json.dump(config, f, indent=2, ensure_ascii=False)


def create_demo_model(path: str, seed: int = 0) -> str:
    """Write a tiny random Qwen3 checkpoint (float32 safetensors), its generation config and the
    demo tokenizer to `path`, unless they are there already. Returns `path`."""
    if all(os.path.isfile(os.path.join(path, f)) for f in _CHECKPOINT_FILES):
        return path
    config = Qwen3Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=True,
        max_position_embeddings=2048,
        eos_token_id=EOS_TOKEN_ID,
        bos_token_id=None,
        pad_token_id=PAD_TOKEN_ID,
    )
    with torch.random.fork_rng(devices=[]):  # seed the weights without touching the caller's RNG
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config).to(torch.float32)
    model.generation_config = GenerationConfig(
        eos_token_id=EOS_TOKEN_ID, pad_token_id=PAD_TOKEN_ID, bos_token_id=None
    )
    model.save_pretrained(path)
    save_tokenizer(path)
    return path
