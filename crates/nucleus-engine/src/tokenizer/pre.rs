//! The pre-tokenizer types of byte-level BPE (`tokenizer.ggml.model = "gpt2"`) vocabularies,
//! chosen by `tokenizer.ggml.pre` as llama.cpp's `src/llama-vocab.cpp` chooses them: the name
//! table of `llama_vocab::impl::load`, each type's regular expressions from the constructor of
//! `llm_tokenizer_bpe`, and the per-type defaults (`ignore_merges`, `add_bos`, `clean_spaces`)
//! set next to the names in `load`.

/// One pre-tokenizer type: its regular expressions, applied one after the other (each splits
/// every piece the previous ones produced, matches kept as pieces of their own: Hugging Face's
/// `Split` with `Isolated` behaviour, llama.cpp's `unicode_regex_split`), and its defaults.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PreType {
    /// llama.cpp's `LLAMA_VOCAB_PRE_TYPE_*` name, in lower case (for messages).
    pub name: &'static str,
    /// The regular expressions of `llm_tokenizer_bpe` for this type.
    pub regexes: &'static [&'static str],
    /// A word that is a whole token is that token, without applying merges (`ignore_merges`).
    pub ignore_merges: bool,
    /// llama.cpp's `add_bos` default when the file has no `tokenizer.ggml.add_bos_token`.
    pub add_bos: bool,
    /// llama.cpp's `clean_spaces` (detokenisation clean-up of " ," and the like); recorded,
    /// not applied: [`super::ModelTokenizer::decode`] is lossless.
    pub clean_spaces: bool,
}

/// GPT-2's pattern (`LLAMA_VOCAB_PRE_TYPE_GPT2` and others).
const GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)";
/// Llama 3's pattern as llama.cpp adapts it (the case-insensitive group spelled out).
const LLAMA3: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen2's pattern: Llama 3's with single digits.
const QWEN2: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

const DEFAULT_RE: &[&str] = &[r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", "[0-9][0-9][0-9]"];
/// DeepSeek LLM's: the letter class is Unicode's cased letters (LC), written with escapes so
/// that no editor's normalisation (NFC turns U+1F7D into U+03CE, U+2126 into U+03A9, ...) can
/// change it.
const DEEPSEEK_LLM_RE: &[&str] = &[
    "[\r\n]",
    "\\s?[A-Za-z\u{B5}\u{C0}-\u{D6}\u{D8}-\u{F6}\u{F8}-\u{1BA}\u{1BC}-\u{1BF}\u{1C4}-\u{293}\u{295}-\u{2AF}\u{370}-\u{373}\u{376}\u{377}\u{37B}-\u{37D}\u{37F}\u{386}\u{388}-\u{38A}\u{38C}\u{38E}-\u{3A1}\u{3A3}-\u{3F5}\u{3F7}-\u{481}\u{48A}-\u{52F}\u{531}-\u{556}\u{10A0}-\u{10C5}\u{13A0}-\u{13F5}\u{13F8}-\u{13FD}\u{1C90}-\u{1CBA}\u{1CBD}-\u{1CBF}\u{1D00}-\u{1D2B}\u{1D6B}-\u{1D77}\u{1D79}-\u{1D9A}\u{1E00}-\u{1F15}\u{1F18}-\u{1F1D}\u{1F20}-\u{1F45}\u{1F48}-\u{1F4D}\u{1F50}-\u{1F57}\u{1F59}\u{1F5B}\u{1F5D}\u{1F5F}-\u{1F7D}\u{1F80}-\u{1FB4}\u{1FB6}-\u{1FBC}\u{1FBE}\u{1FC2}-\u{1FC4}\u{1FC6}-\u{1FCC}\u{1FD0}-\u{1FD3}\u{1FD6}-\u{1FDB}\u{1FE0}-\u{1FEC}\u{1FF2}-\u{1FF4}\u{1FF6}-\u{1FFC}\u{2102}\u{2107}\u{210A}-\u{2113}\u{2115}\u{2119}-\u{211D}\u{2124}\u{2126}\u{2128}\u{212A}-\u{212D}\u{212F}-\u{2134}\u{2139}\u{213C}-\u{213F}\u{2145}-\u{2149}\u{214E}\u{2183}\u{2184}\u{2C00}-\u{2C7B}\u{2C7E}-\u{2CE4}\u{2CEB}-\u{2CEE}\u{2CF2}\u{2CF3}\u{A640}-\u{A66D}\u{A680}-\u{A69B}\u{A722}-\u{A76F}\u{A771}-\u{A787}\u{A78B}-\u{A78E}\u{AB70}-\u{ABBF}\u{FB00}-\u{FB06}\u{FB13}-\u{FB17}\u{FF21}-\u{FF3A}\u{FF41}-\u{FF5A}\u{10400}-\u{1044F}\u{104B0}-\u{104D3}\u{104D8}-\u{104FB}\u{10C80}-\u{10CB2}\u{10CC0}-\u{10CF2}\u{118A0}-\u{118DF}\u{1E900}-\u{1E943}]+",
    r"\s?[!-/:-~！-／：-～‘-‟　-。]+",
    r"\s+$",
    "[一-龥ࠀ-一가-퟿]+",
    r"\p{N}+",
];
const DEEPSEEK_CODER_RE: &[&str] = &[
    "[\r\n]",
    r"\s?\p{L}+",
    r"\s?\p{P}+",
    "[一-龥ࠀ-一가-퟿]+",
    r"\p{N}",
];
const FALCON_RE: &[&str] = &[r"[\p{P}\$\+<=>\^~\|`]+", GPT2, "[0-9][0-9][0-9]"];
const STARCODER_RE: &[&str] = &[r"\p{N}", GPT2];

const fn pre(
    name: &'static str,
    regexes: &'static [&'static str],
    ignore_merges: bool,
    add_bos: bool,
    clean_spaces: bool,
) -> PreType {
    PreType {
        name,
        regexes,
        ignore_merges,
        add_bos,
        clean_spaces,
    }
}

const DEFAULT: PreType = pre("default", DEFAULT_RE, false, false, true);
const LLAMA3_T: PreType = pre("llama3", &[LLAMA3], true, true, true);
const DBRX: PreType = pre("dbrx", &[LLAMA3], false, false, true);
const SMAUG: PreType = pre("smaug", &[LLAMA3], false, false, true);
const DEEPSEEK_LLM: PreType = pre("deepseek_llm", DEEPSEEK_LLM_RE, false, false, false);
const DEEPSEEK_CODER: PreType = pre("deepseek_coder", DEEPSEEK_CODER_RE, false, false, false);
const FALCON: PreType = pre("falcon", FALCON_RE, false, false, true);
const GPT2_T: PreType = pre("gpt2", &[GPT2], false, false, true);
const MPT: PreType = pre("mpt", &[GPT2], false, false, true);
const OLMO: PreType = pre("olmo", &[GPT2], false, false, true);
const JAIS: PreType = pre("jais", &[GPT2], false, false, true);
const STARCODER: PreType = pre("starcoder", STARCODER_RE, false, false, true);
const STARCODER_NO_CLEAN: PreType = pre("starcoder", STARCODER_RE, false, false, false);
const QWEN2_T: PreType = pre("qwen2", &[QWEN2], false, false, false);
const QWEN2_CLEAN: PreType = pre("qwen2", &[QWEN2], false, false, true);
const STABLELM2: PreType = pre("stablelm2", &[QWEN2], false, false, true);

/// `tokenizer.ggml.pre` values and their types, as llama.cpp's `llama_vocab::impl::load`
/// maps them (only the types whose whole behaviour is a regex list and these flags; values
/// that also change BOS / SEP handling or need custom splitting code are left out).
pub(crate) const TABLE: &[(&str, PreType)] = &[
    ("default", DEFAULT),
    ("llama3", LLAMA3_T),
    ("llama-v3", LLAMA3_T),
    ("llama-bpe", LLAMA3_T),
    ("falcon3", LLAMA3_T),
    ("falcon-h1", LLAMA3_T),
    ("pixtral", LLAMA3_T),
    ("midm-2.0", LLAMA3_T),
    ("lfm2", LLAMA3_T),
    ("jina-v5-nano", LLAMA3_T),
    ("dbrx", DBRX),
    ("smaug-bpe", SMAUG),
    ("deepseek-llm", DEEPSEEK_LLM),
    ("deepseek-coder", DEEPSEEK_CODER),
    ("falcon", FALCON),
    ("mpt", MPT),
    ("olmo", OLMO),
    ("jais", JAIS),
    ("starcoder", STARCODER),
    ("refact", STARCODER),
    ("codeshell", STARCODER),
    ("exaone", STARCODER),
    ("minerva-7b", STARCODER),
    ("command-r", STARCODER_NO_CLEAN),
    ("smollm", STARCODER_NO_CLEAN),
    ("gpt-2", GPT2_T),
    ("phi-2", GPT2_T),
    ("jina-es", GPT2_T),
    ("jina-de", GPT2_T),
    ("gigachat", GPT2_T),
    ("jina-v2-es", GPT2_T),
    ("jina-v2-de", GPT2_T),
    ("a.x-4.0", GPT2_T),
    ("mellum", GPT2_T),
    ("modern-bert", GPT2_T),
    ("exaone4", GPT2_T),
    ("qwen2", QWEN2_T),
    ("deepseek-r1-qwen", QWEN2_T),
    ("kormo", QWEN2_T),
    ("f2llmv2", QWEN2_T),
    ("megrez", QWEN2_CLEAN),
    ("stablelm2", STABLELM2),
];

/// The type of `tokenizer.ggml.pre = value`; `None` for a value not in [`TABLE`].
pub(crate) fn lookup(value: &str) -> Option<PreType> {
    TABLE.iter().find(|(n, _)| *n == value).map(|(_, t)| *t)
}

/// The type llama.cpp uses when a file has no `tokenizer.ggml.pre` (with its warning
/// "missing pre-tokenizer type, using: 'default'").
pub(crate) const MISSING: PreType = DEFAULT;

/// The supported values, comma-separated, for messages.
pub(crate) fn supported() -> String {
    TABLE.iter().map(|(n, _)| *n).collect::<Vec<_>>().join(", ")
}
