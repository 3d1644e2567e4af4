//! llama.cpp's GBNF grammar format: a parser that accepts and rejects what llama.cpp's
//! `llama_grammar_parser` accepts and rejects, a translation into llguidance's Lark
//! dialect (the engine that computes token masks), and an Earley recognizer over code
//! points that checks text against the grammar independently of that engine.
//!
//! The format (llama.cpp `grammars/README.md`): rules `name ::= alternatives`, names of
//! letters, digits and `-`; literals `"..."`; character classes `[...]`, `[^...]` with
//! ranges; `.` (any character); groups; `*`, `+`, `?`, `{m}`, `{m,}`, `{m,n}`; tokens
//! `<[id]>`, `<text>` and their negations `!<...>`; `#` comments. A newline ends a rule
//! except inside a group or after `|`. Escapes: `\x.. \u.... \U........ \t \r \n \\ \" \[
//! \] \-`. The grammar starts at `root`.
//!
//! Like llama.cpp this rejects: syntax errors, references to undefined rules, a missing
//! `root`, left recursion (a rule that can reach itself before consuming a character),
//! repetition minimums above 2000 and repetitions whose expansion would exceed 2000
//! rules (llama.cpp's `MAX_REPETITION_THRESHOLD`); a maximum above 2000 means no maximum.

use std::collections::HashMap;
use std::fmt::Write as _;

/// llama.cpp's `MAX_REPETITION_THRESHOLD`.
pub const MAX_REPETITION: u64 = 2000;

/// A grammar llama.cpp would not accept, with where and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct GbnfError(pub String);

/// One item of a sequence.
#[derive(Debug, Clone, PartialEq)]
pub enum Node {
    /// A literal string (possibly empty).
    Lit(Vec<char>),
    /// A character class: inclusive code point ranges, negated or not.
    Class {
        negated: bool,
        ranges: Vec<(u32, u32)>,
    },
    /// `.`: any character.
    Any,
    /// A reference to rule `i`.
    Ref(usize),
    /// A token by id; `negated`: any token but it.
    Token { id: u32, negated: bool },
    /// `( ... )`.
    Group(Vec<Vec<Node>>),
    /// `item{min,max}` (`max: None` = no maximum).
    Repeat {
        item: Box<Node>,
        min: u64,
        max: Option<u64>,
    },
}

/// A parsed GBNF grammar.
#[derive(Debug, Clone, PartialEq)]
pub struct Gbnf {
    /// Rule names, by index.
    pub names: Vec<String>,
    /// Each rule's alternatives.
    pub rules: Vec<Vec<Vec<Node>>>,
    /// Index of `root`.
    pub root: usize,
}

struct Parser<'a> {
    src: &'a [u8],
    text: &'a str,
    pos: usize,
    names: Vec<String>,
    ids: HashMap<String, usize>,
    defs: Vec<Option<Vec<Vec<Node>>>>,
    /// llama.cpp's count of symbol ids (rule names and synthesized rules), which its
    /// repetition limit is computed from.
    n_symbols: u64,
    resolve_token: &'a dyn Fn(&str) -> Option<u32>,
}

fn is_word(c: u8) -> bool {
    c.is_ascii_alphanumeric() || c == b'-'
}

impl<'a> Parser<'a> {
    fn peek(&self) -> u8 {
        self.src.get(self.pos).copied().unwrap_or(0)
    }

    fn at(&self, off: usize) -> u8 {
        self.src.get(self.pos + off).copied().unwrap_or(0)
    }

    fn err<T>(&self, what: &str) -> Result<T, GbnfError> {
        let line = self.text[..self.pos.min(self.text.len())]
            .matches('\n')
            .count()
            + 1;
        let rest: String = self
            .text
            .get(self.pos..)
            .unwrap_or("")
            .chars()
            .take(24)
            .collect();
        Err(GbnfError(if rest.is_empty() {
            format!("{what} at the end of the grammar (line {line})")
        } else {
            format!("{what} at line {line}: {rest:?}")
        }))
    }

    fn space(&mut self, newline_ok: bool) {
        loop {
            match self.peek() {
                b' ' | b'\t' => self.pos += 1,
                b'\r' | b'\n' if newline_ok => self.pos += 1,
                b'#' => {
                    while !matches!(self.peek(), 0 | b'\r' | b'\n') {
                        self.pos += 1;
                    }
                }
                _ => return,
            }
        }
    }

    fn name(&mut self) -> Result<String, GbnfError> {
        let start = self.pos;
        while is_word(self.peek()) {
            self.pos += 1;
        }
        if self.pos == start {
            return self.err("expecting a rule name");
        }
        Ok(self.text[start..self.pos].to_string())
    }

    fn int(&mut self) -> Result<u64, GbnfError> {
        let start = self.pos;
        while self.peek().is_ascii_digit() {
            self.pos += 1;
        }
        if self.pos == start {
            return self.err("expecting an integer");
        }
        match self.text[start..self.pos].parse() {
            Ok(n) => Ok(n),
            Err(_) => self.err("integer too large"),
        }
    }

    fn symbol(&mut self, name: &str) -> usize {
        if let Some(&i) = self.ids.get(name) {
            return i;
        }
        let i = self.names.len();
        self.names.push(name.to_string());
        self.ids.insert(name.to_string(), i);
        self.defs.push(None);
        self.n_symbols += 1;
        i
    }

    fn hex(&mut self, n: usize) -> Result<u32, GbnfError> {
        let mut v = 0u32;
        for _ in 0..n {
            let c = self.peek();
            let d = match c {
                b'0'..=b'9' => c - b'0',
                b'a'..=b'f' => c - b'a' + 10,
                b'A'..=b'F' => c - b'A' + 10,
                _ => return self.err(&format!("expecting {n} hex digits")),
            };
            v = (v << 4) | u32::from(d);
            self.pos += 1;
        }
        Ok(v)
    }

    /// One (possibly escaped) character of a literal or class.
    fn char(&mut self) -> Result<u32, GbnfError> {
        match self.peek() {
            0 if self.pos >= self.src.len() => self.err("unexpected end of input"),
            b'\\' => {
                let c = self.at(1);
                self.pos += 2;
                Ok(match c {
                    b'x' => self.hex(2)?,
                    b'u' => self.hex(4)?,
                    b'U' => self.hex(8)?,
                    b't' => 9,
                    b'r' => 13,
                    b'n' => 10,
                    b'\\' | b'"' | b'[' | b']' | b'-' => u32::from(c),
                    _ => {
                        self.pos -= 2;
                        return self.err("unknown escape");
                    }
                })
            }
            _ => {
                let ch = self.text[self.pos..].chars().next().unwrap_or('\0');
                self.pos += ch.len_utf8();
                Ok(ch as u32)
            }
        }
    }

    fn token(&mut self) -> Result<u32, GbnfError> {
        let start = self.pos;
        self.pos += 1; // '<'
        if self.peek() == b'[' {
            self.pos += 1;
            let id = self.int()?;
            if id > u64::from(u32::MAX) {
                return self.err("token id too large");
            }
            if self.peek() != b']' {
                return self.err("expecting ']'");
            }
            self.pos += 1;
            if self.peek() != b'>' {
                return self.err("expecting '>'");
            }
            self.pos += 1;
            return Ok(id as u32);
        }
        while self.pos < self.src.len() && self.peek() != b'>' {
            self.pos += 1;
        }
        if self.peek() != b'>' {
            return self.err("expecting '>'");
        }
        self.pos += 1;
        let text = &self.text[start..self.pos];
        match (self.resolve_token)(text) {
            Some(id) => Ok(id),
            None => {
                self.pos = start;
                self.err(&format!("token {text} is not one token of this vocabulary"))
            }
        }
    }

    fn alternates(&mut self, rule: &str, nested: bool) -> Result<Vec<Vec<Node>>, GbnfError> {
        let mut alts = vec![self.sequence(rule, nested)?];
        while self.peek() == b'|' {
            self.pos += 1;
            self.space(true);
            alts.push(self.sequence(rule, nested)?);
        }
        Ok(alts)
    }

    fn sequence(&mut self, rule: &str, nested: bool) -> Result<Vec<Node>, GbnfError> {
        let mut seq: Vec<Node> = Vec::new();
        // rules the last item stands for (llama.cpp's n_prev_rules)
        let mut n_prev: u64 = 1;
        loop {
            let c = self.peek();
            match c {
                b'"' => {
                    self.pos += 1;
                    let mut s = Vec::new();
                    while self.peek() != b'"' {
                        if self.pos >= self.src.len() {
                            return self.err("unexpected end of input in a literal");
                        }
                        let c = self.char()?;
                        s.push(char::from_u32(c).unwrap_or('\u{FFFD}'));
                    }
                    self.pos += 1;
                    self.space(nested);
                    seq.push(Node::Lit(s));
                    n_prev = 1;
                }
                b'[' => {
                    self.pos += 1;
                    let negated = self.peek() == b'^';
                    if negated {
                        self.pos += 1;
                    }
                    let mut ranges = Vec::new();
                    while self.peek() != b']' {
                        if self.pos >= self.src.len() {
                            return self.err("unexpected end of input in a character class");
                        }
                        let lo = self.char()?;
                        let mut hi = lo;
                        if self.peek() == b'-' && self.at(1) != b']' {
                            if self.pos + 1 >= self.src.len() {
                                return self.err("unexpected end of input in a character class");
                            }
                            self.pos += 1;
                            hi = self.char()?;
                        }
                        ranges.push((lo, hi));
                    }
                    self.pos += 1;
                    self.space(nested);
                    seq.push(Node::Class { negated, ranges });
                    n_prev = 1;
                }
                b'<' | b'!' => {
                    let negated = c == b'!';
                    if negated {
                        self.pos += 1;
                        if self.peek() != b'<' {
                            return self.err("expecting '<' after '!'");
                        }
                    }
                    let id = self.token()?;
                    self.space(nested);
                    seq.push(Node::Token { id, negated });
                    n_prev = 1;
                }
                c if is_word(c) => {
                    let name = self.name()?;
                    let id = self.symbol(&name);
                    self.space(nested);
                    seq.push(Node::Ref(id));
                    n_prev = 1;
                }
                b'(' => {
                    self.pos += 1;
                    self.space(true);
                    let before = self.n_symbols;
                    self.n_symbols += 1; // the group's own rule
                    let alts = self.alternates(rule, true)?;
                    n_prev = (self.n_symbols - before).max(1);
                    if self.peek() != b')' {
                        return self.err("expecting ')'");
                    }
                    self.pos += 1;
                    self.space(nested);
                    seq.push(Node::Group(alts));
                }
                b'.' => {
                    self.pos += 1;
                    self.space(nested);
                    seq.push(Node::Any);
                    n_prev = 1;
                }
                b'*' | b'+' | b'?' | b'{' => {
                    let (min, max) = match c {
                        b'*' => {
                            self.pos += 1;
                            (0, None)
                        }
                        b'+' => {
                            self.pos += 1;
                            (1, None)
                        }
                        b'?' => {
                            self.pos += 1;
                            (0, Some(1))
                        }
                        _ => {
                            self.pos += 1;
                            self.space(nested);
                            if !self.peek().is_ascii_digit() {
                                return self.err("expecting an integer after '{'");
                            }
                            let min = self.int()?;
                            self.space(nested);
                            let max = match self.peek() {
                                b'}' => Some(min),
                                b',' => {
                                    self.pos += 1;
                                    self.space(nested);
                                    let max = if self.peek().is_ascii_digit() {
                                        let m = self.int()?;
                                        self.space(nested);
                                        Some(m)
                                    } else {
                                        None
                                    };
                                    if self.peek() != b'}' {
                                        return self.err("expecting '}'");
                                    }
                                    max
                                }
                                _ => return self.err("expecting ',' or '}'"),
                            };
                            self.pos += 1;
                            if min > MAX_REPETITION {
                                return self
                                    .err(&format!("a repetition minimum above {MAX_REPETITION}"));
                            }
                            (min, max.filter(|&m| m <= MAX_REPETITION))
                        }
                    };
                    self.space(nested);
                    let Some(item) = seq.pop() else {
                        return self.err("expecting an item before */+/?/{");
                    };
                    let total = match max {
                        Some(m) if m > 0 => m,
                        _ if min > 0 => min,
                        _ => 1,
                    };
                    if n_prev.saturating_mul(total) > MAX_REPETITION {
                        return self.err(&format!(
                            "this repetition would expand to more than {MAX_REPETITION} rules"
                        ));
                    }
                    if let Some(m) = max {
                        if m < min {
                            return self.err(&format!(
                                "a repetition maximum ({m}) below its minimum ({min})"
                            ));
                        }
                    }
                    self.n_symbols += match max {
                        None => 1,
                        Some(m) => m - min,
                    };
                    n_prev *= total;
                    seq.push(Node::Repeat {
                        item: Box::new(item),
                        min,
                        max,
                    });
                }
                _ => return Ok(seq),
            }
        }
    }

    fn rule(&mut self) -> Result<(), GbnfError> {
        let name = self.name()?;
        self.space(false);
        if !self.text[self.pos..].starts_with("::=") {
            return self.err("expecting ::=");
        }
        self.pos += 3;
        self.space(true);
        let id = self.symbol(&name);
        let alts = self.alternates(&name, false)?;
        // like llama.cpp, a later definition replaces an earlier one
        self.defs[id] = Some(alts);
        match self.peek() {
            b'\r' => {
                self.pos += if self.at(1) == b'\n' { 2 } else { 1 };
            }
            b'\n' => self.pos += 1,
            _ if self.pos >= self.src.len() => {}
            _ => return self.err("expecting a newline or the end"),
        }
        self.space(true);
        Ok(())
    }
}

impl Gbnf {
    /// Parses and checks a grammar. `resolve_token` maps the text of a `<token>` item to
    /// its id (exactly one token of the vocabulary), or `None`.
    pub fn parse(
        text: &str,
        resolve_token: &dyn Fn(&str) -> Option<u32>,
    ) -> Result<Gbnf, GbnfError> {
        let mut p = Parser {
            src: text.as_bytes(),
            text,
            pos: 0,
            names: Vec::new(),
            ids: HashMap::new(),
            defs: Vec::new(),
            n_symbols: 0,
            resolve_token,
        };
        p.space(true);
        while p.pos < p.src.len() {
            p.rule()?;
        }
        let mut rules = Vec::with_capacity(p.defs.len());
        for (i, d) in p.defs.into_iter().enumerate() {
            match d {
                Some(alts) => rules.push(alts),
                None => {
                    return Err(GbnfError(format!(
                        "undefined rule '{}' (referenced but never defined)",
                        p.names[i]
                    )))
                }
            }
        }
        let Some(&root) = p.ids.get("root") else {
            return Err(GbnfError(
                "the grammar has no 'root' rule (where generation starts)".into(),
            ));
        };
        let g = Gbnf {
            names: p.names,
            rules,
            root,
        };
        g.check_left_recursion()?;
        Ok(g)
    }

    /// Whether each rule can match the empty string.
    fn nullable(&self) -> Vec<bool> {
        let mut null = vec![false; self.rules.len()];
        loop {
            let mut changed = false;
            for (i, alts) in self.rules.iter().enumerate() {
                if !null[i] && alts.iter().any(|s| seq_nullable(s, &null)) {
                    null[i] = true;
                    changed = true;
                }
            }
            if !changed {
                return null;
            }
        }
    }

    /// Rejects a rule that can reach itself before consuming anything.
    fn check_left_recursion(&self) -> Result<(), GbnfError> {
        let null = self.nullable();
        // left[i]: rules that rule i can start with
        let left: Vec<Vec<usize>> = self
            .rules
            .iter()
            .map(|alts| {
                let mut out = Vec::new();
                for s in alts {
                    left_refs_seq(s, &null, &mut out);
                }
                out
            })
            .collect();
        // 0 = unvisited, 1 = on the stack, 2 = done
        let mut state = vec![0u8; self.rules.len()];
        fn visit(
            i: usize,
            left: &[Vec<usize>],
            state: &mut [u8],
            path: &mut Vec<usize>,
        ) -> Option<Vec<usize>> {
            state[i] = 1;
            path.push(i);
            for &j in &left[i] {
                if state[j] == 1 {
                    let from = path.iter().position(|&k| k == j).unwrap_or(0);
                    let mut cycle = path[from..].to_vec();
                    cycle.push(j);
                    return Some(cycle);
                }
                if state[j] == 0 {
                    if let Some(c) = visit(j, left, state, path) {
                        return Some(c);
                    }
                }
            }
            path.pop();
            state[i] = 2;
            None
        }
        for i in 0..self.rules.len() {
            if state[i] == 0 {
                if let Some(cycle) = visit(i, &left, &mut state, &mut Vec::new()) {
                    let names: Vec<&str> = cycle.iter().map(|&k| self.names[k].as_str()).collect();
                    return Err(GbnfError(format!(
                        "left recursion: {} (a rule reaches itself before any character)",
                        names.join(" -> ")
                    )));
                }
            }
        }
        Ok(())
    }
}

fn node_nullable(n: &Node, null: &[bool]) -> bool {
    match n {
        Node::Lit(s) => s.is_empty(),
        Node::Class { .. } | Node::Any | Node::Token { .. } => false,
        Node::Ref(i) => null[*i],
        Node::Group(alts) => alts.iter().any(|s| seq_nullable(s, null)),
        Node::Repeat { item, min, .. } => *min == 0 || node_nullable(item, null),
    }
}

fn seq_nullable(s: &[Node], null: &[bool]) -> bool {
    s.iter().all(|n| node_nullable(n, null))
}

fn left_refs_node(n: &Node, null: &[bool], out: &mut Vec<usize>) {
    match n {
        Node::Ref(i) => out.push(*i),
        Node::Group(alts) => {
            for s in alts {
                left_refs_seq(s, null, out);
            }
        }
        Node::Repeat { item, .. } => left_refs_node(item, null, out),
        _ => {}
    }
}

fn left_refs_seq(s: &[Node], null: &[bool], out: &mut Vec<usize>) {
    for n in s {
        left_refs_node(n, null, out);
        if !node_nullable(n, null) {
            return;
        }
    }
}

// ---------------------------------------------------------------------------------------
// Translation into llguidance's Lark dialect.
//
// llguidance lexes with regular expressions and parses lexemes with an Earley parser. A
// GBNF rule that is not recursive and uses no tokens describes a regular language, so it
// becomes a Lark terminal (UPPERCASE), and so does every run of such items inside a
// sequence; everything else becomes a Lark rule (lowercase). Inside a terminal the
// language is exactly GBNF's; at the boundary between two lexemes llguidance's lexer is
// greedy (the longest match wins), which GBNF is not: a grammar whose regular part must
// give characters back to what follows it (`root ::= x "a" r`, `x ::= [a-z]*`, with `r`
// recursive) generates fewer strings than llama.cpp's engine would, never more.

/// A Rust-regex rendering of one code point.
fn rx_char(c: u32, out: &mut String) {
    match char::from_u32(c) {
        Some(ch) if ch.is_ascii_alphanumeric() || ch == ' ' => out.push(ch),
        _ => {
            let _ = write!(out, "\\x{{{c:x}}}");
        }
    }
}

struct Lark<'g> {
    g: &'g Gbnf,
    terminal: Vec<bool>,
    out: String,
    extra: Vec<String>,
}

impl Lark<'_> {
    fn rule_name(&self, i: usize) -> String {
        let clean: String = self.g.names[i]
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
            .collect();
        if self.terminal[i] {
            format!("T{i}_{}", clean.to_ascii_uppercase())
        } else {
            format!("r{i}_{}", clean.to_ascii_lowercase())
        }
    }

    fn node_is_terminal(&self, n: &Node) -> bool {
        match n {
            Node::Lit(_) | Node::Class { .. } | Node::Any => true,
            Node::Token { .. } => false,
            Node::Ref(i) => self.terminal[*i],
            Node::Group(alts) => alts
                .iter()
                .all(|s| s.iter().all(|n| self.node_is_terminal(n))),
            Node::Repeat { item, .. } => self.node_is_terminal(item),
        }
    }

    /// A terminal expression (inside a terminal definition or a regex-only run).
    fn term(&self, n: &Node, out: &mut String) {
        match n {
            Node::Lit(s) if s.is_empty() => out.push_str("\"\""),
            Node::Lit(s) => {
                out.push('/');
                for &c in s {
                    rx_char(c as u32, out);
                }
                out.push('/');
            }
            Node::Class { negated, ranges } => {
                out.push_str(if *negated { "/[^" } else { "/[" });
                for &(lo, hi) in ranges {
                    rx_char(lo, out);
                    if hi != lo {
                        out.push('-');
                        rx_char(hi, out);
                    }
                }
                out.push_str("]/");
            }
            Node::Any => out.push_str("/(?s:.)/"),
            Node::Ref(i) => out.push_str(&self.rule_name(*i)),
            Node::Token { .. } => unreachable!("tokens are never terminal"),
            Node::Group(alts) => {
                out.push('(');
                self.term_alts(alts, out);
                out.push(')');
            }
            Node::Repeat { item, min, max } => {
                out.push('(');
                self.term(item, out);
                out.push(')');
                repeat_suffix(*min, *max, out);
            }
        }
    }

    fn term_alts(&self, alts: &[Vec<Node>], out: &mut String) {
        for (k, s) in alts.iter().enumerate() {
            if k > 0 {
                out.push_str(" | ");
            }
            if s.is_empty() {
                out.push_str("\"\"");
            }
            for (j, n) in s.iter().enumerate() {
                if j > 0 {
                    out.push(' ');
                }
                self.term(n, out);
            }
        }
    }

    /// A rule expression: runs of terminal items become one synthesized terminal.
    fn seq(&mut self, s: &[Node], out: &mut String) {
        let mut j = 0;
        let mut first = true;
        while j < s.len() {
            if !first {
                out.push(' ');
            }
            first = false;
            if self.node_is_terminal(&s[j]) {
                let start = j;
                while j < s.len() && self.node_is_terminal(&s[j]) {
                    j += 1;
                }
                let mut body = String::new();
                for (k, n) in s[start..j].iter().enumerate() {
                    if k > 0 {
                        body.push(' ');
                    }
                    self.term(n, &mut body);
                }
                let name = format!("L{}", self.extra.len());
                self.extra.push(format!("{name}: {body}\n"));
                out.push_str(&name);
                continue;
            }
            let n = &s[j];
            j += 1;
            match n {
                Node::Ref(i) => out.push_str(&self.rule_name(*i)),
                Node::Token { id, negated } => {
                    let _ = write!(out, "<[{}{id}]>", if *negated { "^" } else { "" });
                }
                Node::Group(alts) => {
                    out.push('(');
                    self.alts(alts, out);
                    out.push(')');
                }
                Node::Repeat { item, min, max } => {
                    out.push('(');
                    self.seq(std::slice::from_ref(item), out);
                    out.push(')');
                    repeat_suffix(*min, *max, out);
                }
                _ => unreachable!("terminal items are handled above"),
            }
        }
    }

    fn alts(&mut self, alts: &[Vec<Node>], out: &mut String) {
        let nonempty: Vec<&Vec<Node>> = alts.iter().filter(|s| !s.is_empty()).collect();
        let optional = nonempty.len() < alts.len();
        if nonempty.is_empty() {
            out.push_str("\"\"");
            return;
        }
        if optional {
            out.push('(');
        }
        for (k, s) in nonempty.iter().enumerate() {
            if k > 0 {
                out.push_str(" | ");
            }
            self.seq(s, out);
        }
        if optional {
            out.push_str(")?");
        }
    }
}

fn repeat_suffix(min: u64, max: Option<u64>, out: &mut String) {
    match (min, max) {
        (0, None) => out.push('*'),
        (1, None) => out.push('+'),
        (0, Some(1)) => out.push('?'),
        (m, None) => {
            let _ = write!(out, "{{{m},}}");
        }
        (m, Some(n)) => {
            let _ = write!(out, "{{{m},{n}}}");
        }
    }
}

impl Gbnf {
    /// Which rules describe regular languages: no recursion, no tokens.
    fn terminal_rules(&self) -> Vec<bool> {
        // 0 = unknown, 1 = in progress, 2 = terminal, 3 = not terminal
        fn visit(g: &Gbnf, i: usize, st: &mut [u8]) -> bool {
            match st[i] {
                1 | 3 => return false,
                2 => return true,
                _ => {}
            }
            st[i] = 1;
            fn node(g: &Gbnf, n: &Node, st: &mut [u8]) -> bool {
                match n {
                    Node::Lit(_) | Node::Class { .. } | Node::Any => true,
                    Node::Token { .. } => false,
                    Node::Ref(j) => visit(g, *j, st),
                    Node::Group(alts) => alts.iter().all(|s| s.iter().all(|n| node(g, n, st))),
                    Node::Repeat { item, .. } => node(g, item, st),
                }
            }
            let ok = g.rules[i].iter().all(|s| s.iter().all(|n| node(g, n, st)));
            st[i] = if ok { 2 } else { 3 };
            ok
        }
        let mut st = vec![0u8; self.rules.len()];
        (0..self.rules.len())
            .map(|i| visit(self, i, &mut st))
            .collect()
    }

    /// The grammar in llguidance's Lark dialect (see the comment above [`rx_char`]).
    pub fn to_lark(&self) -> String {
        let mut l = Lark {
            g: self,
            terminal: self.terminal_rules(),
            out: String::new(),
            extra: Vec::new(),
        };
        let mut out = String::from("%llguidance {}\n");
        let _ = writeln!(out, "start: {}", l.rule_name(self.root));
        for i in 0..self.rules.len() {
            let name = l.rule_name(i);
            let mut body = String::new();
            if l.terminal[i] {
                l.term_alts(&self.rules[i], &mut body);
            } else {
                l.alts(&self.rules[i], &mut body);
            }
            let _ = writeln!(out, "{name}: {body}");
        }
        l.out = out;
        for e in &l.extra {
            l.out.push_str(e);
        }
        l.out
    }
}

// ---------------------------------------------------------------------------------------
// An Earley recognizer over code points, for checking text against a grammar without
// llguidance (tests, debugging). Tokens (`<...>`) cannot be matched by text and never
// match here.

#[derive(Debug, Clone, PartialEq)]
enum Sym {
    Char {
        negated: bool,
        ranges: Vec<(u32, u32)>,
    },
    Any,
    Rule(usize),
    Never,
}

/// A grammar flattened into plain context-free rules of single-character terminals.
#[derive(Debug, Clone)]
pub struct Recognizer {
    /// rule -> alternatives -> symbols
    rules: Vec<Vec<Vec<Sym>>>,
    root: usize,
    nullable: Vec<bool>,
}

/// How a text relates to a grammar.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Match {
    /// The whole text is a sentence of the grammar.
    Complete,
    /// The text is a proper beginning of some sentence.
    Prefix,
    /// No sentence begins with the text.
    Invalid,
}

impl Recognizer {
    pub fn new(g: &Gbnf) -> Self {
        let mut r = Recognizer {
            rules: vec![Vec::new(); g.rules.len()],
            root: g.root,
            nullable: Vec::new(),
        };
        for (i, alts) in g.rules.iter().enumerate() {
            let a = alts.iter().map(|s| r.flatten_seq(s)).collect();
            r.rules[i] = a;
        }
        r.nullable = r.compute_nullable();
        r
    }

    fn new_rule(&mut self, alts: Vec<Vec<Sym>>) -> usize {
        self.rules.push(alts);
        self.rules.len() - 1
    }

    fn flatten_seq(&mut self, s: &[Node]) -> Vec<Sym> {
        let mut out = Vec::new();
        for n in s {
            self.flatten_node(n, &mut out);
        }
        out
    }

    fn flatten_node(&mut self, n: &Node, out: &mut Vec<Sym>) {
        match n {
            Node::Lit(s) => out.extend(s.iter().map(|&c| Sym::Char {
                negated: false,
                ranges: vec![(c as u32, c as u32)],
            })),
            Node::Class { negated, ranges } => out.push(Sym::Char {
                negated: *negated,
                ranges: ranges.clone(),
            }),
            Node::Any => out.push(Sym::Any),
            Node::Ref(i) => out.push(Sym::Rule(*i)),
            Node::Token { .. } => out.push(Sym::Never),
            Node::Group(alts) => {
                let a = alts.iter().map(|s| self.flatten_seq(s)).collect();
                let id = self.new_rule(a);
                out.push(Sym::Rule(id));
            }
            Node::Repeat { item, min, max } => {
                let mut one = Vec::new();
                self.flatten_node(item, &mut one);
                for _ in 0..*min {
                    out.extend(one.iter().cloned());
                }
                match max {
                    None => {
                        // R ::= item R | ε
                        let id = self.new_rule(Vec::new());
                        let mut rec = one.clone();
                        rec.push(Sym::Rule(id));
                        self.rules[id] = vec![rec, Vec::new()];
                        out.push(Sym::Rule(id));
                    }
                    Some(m) if *m > *min => {
                        // R_k ::= item R_{k-1} | ε, R_1 ::= item | ε
                        let mut prev: Option<usize> = None;
                        for _ in 0..(m - min) {
                            let mut alt = one.clone();
                            if let Some(p) = prev {
                                alt.push(Sym::Rule(p));
                            }
                            prev = Some(self.new_rule(vec![alt, Vec::new()]));
                        }
                        if let Some(p) = prev {
                            out.push(Sym::Rule(p));
                        }
                    }
                    Some(_) => {}
                }
            }
        }
    }

    fn compute_nullable(&self) -> Vec<bool> {
        let mut null = vec![false; self.rules.len()];
        loop {
            let mut changed = false;
            for (i, alts) in self.rules.iter().enumerate() {
                if !null[i]
                    && alts.iter().any(|s| {
                        s.iter().all(|x| match x {
                            Sym::Rule(j) => null[*j],
                            _ => false,
                        })
                    })
                {
                    null[i] = true;
                    changed = true;
                }
            }
            if !changed {
                return null;
            }
        }
    }

    /// Checks `text` (Earley's algorithm, with nullable rules completed at prediction).
    pub fn check(&self, text: &str) -> Match {
        // item: (rule, alternative, dot, origin)
        type Item = (usize, usize, usize, usize);
        let chars: Vec<u32> = text.chars().map(|c| c as u32).collect();
        let mut sets: Vec<Vec<Item>> = vec![Vec::new(); chars.len() + 1];
        let mut seen: Vec<std::collections::HashSet<Item>> =
            vec![std::collections::HashSet::new(); chars.len() + 1];
        let start: usize = self.rules.len(); // a virtual start item
        let add = |sets: &mut Vec<Vec<Item>>,
                   seen: &mut Vec<std::collections::HashSet<Item>>,
                   k: usize,
                   it: Item| {
            if seen[k].insert(it) {
                sets[k].push(it);
            }
        };
        add(&mut sets, &mut seen, 0, (start, 0, 0, 0));
        let sym_at = |rule: usize, alt: usize, dot: usize| -> Option<Sym> {
            if rule == start {
                return (dot == 0).then_some(Sym::Rule(self.root));
            }
            self.rules[rule][alt].get(dot).cloned()
        };
        for k in 0..=chars.len() {
            let mut i = 0;
            while i < sets[k].len() {
                let (rule, alt, dot, origin) = sets[k][i];
                i += 1;
                match sym_at(rule, alt, dot) {
                    Some(Sym::Rule(r)) => {
                        for a in 0..self.rules[r].len() {
                            add(&mut sets, &mut seen, k, (r, a, 0, k));
                        }
                        if self.nullable[r] {
                            add(&mut sets, &mut seen, k, (rule, alt, dot + 1, origin));
                        }
                    }
                    Some(Sym::Never) => {}
                    Some(term) => {
                        if k < chars.len() {
                            let c = chars[k];
                            let ok = match &term {
                                Sym::Any => true,
                                Sym::Char { negated, ranges } => {
                                    ranges.iter().any(|&(lo, hi)| lo <= c && c <= hi) != *negated
                                }
                                _ => false,
                            };
                            if ok {
                                add(&mut sets, &mut seen, k + 1, (rule, alt, dot + 1, origin));
                            }
                        }
                    }
                    None => {
                        if rule == start {
                            continue;
                        }
                        // complete: advance the items of set `origin` waiting for `rule`
                        let mut j = 0;
                        while j < sets[origin].len() {
                            let (r2, a2, d2, o2) = sets[origin][j];
                            j += 1;
                            if sym_at(r2, a2, d2) == Some(Sym::Rule(rule)) {
                                add(&mut sets, &mut seen, k, (r2, a2, d2 + 1, o2));
                            }
                        }
                    }
                }
            }
            if k < chars.len() && sets[k + 1].is_empty() {
                return Match::Invalid;
            }
        }
        if seen[chars.len()].contains(&(start, 0, 1, 0)) {
            Match::Complete
        } else {
            Match::Prefix
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str) -> Result<Gbnf, GbnfError> {
        Gbnf::parse(s, &|t| (t == "<think>").then_some(7))
    }

    /// Grammars llama.cpp's parser refuses (tests/test-grammar-parser.cpp,
    /// tests/test-grammar-integration.cpp), each with the reason we give.
    #[test]
    fn rejects_what_llama_cpp_rejects() {
        let cases = [
            (r#"root ::= "a"{,}"#, "expecting an integer"),
            (r#"root ::= "a"{,10}"#, "expecting an integer"),
            (
                r#"root ::= (((((([^x]*){0,99}){0,99}){0,99}){0,99}){0,99}){0,99}"#,
                "more than 2000 rules",
            ),
            (r#"root ::= "a"{5000}"#, "minimum above 2000"),
            (r#"root ::= "a"{5000,}"#, "minimum above 2000"),
            (r#"root ::= "a"{5000,6000}"#, "minimum above 2000"),
            ("rot ::= expr\nexpr ::= [0-9]+", "no 'root' rule"),
            (
                "root ::= expr\nexpr ::= term (\"+\" term)*\nterm ::= numero\nnumber ::= [0-9]+",
                "undefined rule 'numero'",
            ),
            (r#"root ::= "a" | root "a""#, "left recursion"),
            ("root ::= asdf\nasdf ::= \"a\" | asdf \"a\"", "left recursion"),
            (
                "root ::= asdf\nasdf ::= \"a\" | foo \"b\"\nfoo ::= \"c\" | asdf \"d\" | \"e\"",
                "left recursion",
            ),
            (
                "root ::= asdf\nasdf ::= \"a\" | foo \"b\"\nfoo ::= \"c\" | empty asdf \"d\" | \"e\"\nempty ::= \"blah\" | ",
                "left recursion",
            ),
            (r#"root ::= "abc"#, "unexpected end of input"),
            (r#"root ::= [a-z"#, "unexpected end of input"),
            (r#"root ::= ("a" "b""#, "expecting ')'"),
            (r#"root ::= "\q""#, "unknown escape"),
            (r#"root ::= "\x4""#, "hex digits"),
            ("root = \"a\"", "expecting ::="),
            ("root ::= * \"a\"", "expecting an item"),
            ("root ::= \"a\" )", "expecting a newline"),
            ("root ::= <nope>", "not one token"),
            ("root ::= \"a\"{3,2}", "maximum (2) below its minimum (3)"),
        ];
        for (g, want) in cases {
            match parse(g) {
                Ok(_) => panic!("accepted {g:?}"),
                Err(e) => assert!(e.0.contains(want), "{g:?}: {e} (wanted {want:?})"),
            }
        }
    }

    #[test]
    fn accepts_what_llama_cpp_accepts() {
        for g in [
            r#"root ::= "a"{0,5000}"#,
            r#"root ::= "a"{3,5000}"#,
            "root  ::= \"a\" | [bdx-z] | [^1-3]",
            "root ::= a+\na ::= \"a\"",
            "root ::= (\n  \"x\"\n  | \"y\"  # comment\n)\n\n# trailing",
            "root ::= \"a\" |\n  \"b\"",
            "root ::= <think> [^x]* <[7]> !<[3]>",
            "root ::= x\nx ::= \"\" | \"a\" x",
            "root ::= [\\x00-\\x1F\\u00e9\\U0001F600] . [\\-\\]]",
        ] {
            parse(g).unwrap_or_else(|e| panic!("{g:?}: {e}"));
        }
    }

    #[test]
    fn recognizer_follows_the_grammar() {
        let g = parse(
            "root ::= \"(\" list? \")\" ws\nlist ::= item (\",\" ws item){0,2}\nitem ::= [a-z]+ | root\nws ::= [ ]*",
        )
        .unwrap();
        let r = Recognizer::new(&g);
        assert_eq!(r.check("()"), Match::Complete);
        assert_eq!(r.check("(ab, c,(x))  "), Match::Complete);
        assert_eq!(r.check("(ab, c,(x)"), Match::Prefix);
        assert_eq!(r.check(""), Match::Prefix);
        assert_eq!(r.check("(a,b,c,d)"), Match::Invalid);
        assert_eq!(r.check("(A)"), Match::Invalid);
        assert_eq!(r.check("()x"), Match::Invalid);
    }

    #[test]
    fn lark_marks_regular_rules_as_terminals() {
        let g = parse(
            "root ::= \"{\" ws (pair (\",\" ws pair)*)? \"}\"\npair ::= key \":\" ws root | key \":\" ws num\nkey ::= \"\\\"\" [a-z]+ \"\\\"\"\nnum ::= [0-9]+\nws ::= [ ]?",
        )
        .unwrap();
        let lark = g.to_lark();
        assert!(lark.contains("_KEY: "), "{lark}");
        assert!(lark.contains("_NUM: "), "{lark}");
        assert!(lark.contains("r0_root: "), "{lark}");
        assert!(lark.contains("_pair: "), "{lark}");
    }
}
