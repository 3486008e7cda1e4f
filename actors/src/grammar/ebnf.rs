//! GBNF-style EBNF (`name ::= expr`, root rule `root`, `"text"`, `[a-z]`, `[^"]`, `.`, `|`, `*`,
//! `+`, `?`, `{m,n}`, `( )`, `#` comments) translated into llguidance's Lark dialect, so requests
//! may send the grammar format llama.cpp and many clients use.

use super::GrammarError;

#[derive(Debug, Clone, PartialEq)]
enum Piece {
    Name(String),
    Defines,
    Literal(String),
    /// A character class, brackets included.
    Class(String),
    AnyChar,
    Operator(char),
    Repeat(String),
}

/// Translate a GBNF-style grammar into Lark. Rules become one line each; rule `root` becomes
/// `start`; every other name gets the prefix `r_` (Lark rule names are lower case).
pub(crate) fn ebnf_to_lark(source: &str) -> Result<String, GrammarError> {
    let pieces = lex(source)?;
    let mut rules: Vec<(String, Vec<String>)> = Vec::new();
    let mut i = 0;
    while i < pieces.len() {
        if let (Piece::Name(name), Some(Piece::Defines)) = (&pieces[i], pieces.get(i + 1)) {
            rules.push((rule_name(name), Vec::new()));
            i += 2;
            continue;
        }
        let Some((_, body)) = rules.last_mut() else {
            return Err(invalid(
                "the grammar must start with a rule (`name ::= ...`)",
            ));
        };
        body.push(match &pieces[i] {
            Piece::Name(name) => rule_name(name),
            Piece::Defines => return Err(invalid("`::=` without a rule name before it")),
            Piece::Literal(text) => text.clone(),
            Piece::Class(class) => format!("/{}/", class.replace('/', "\\/")),
            Piece::AnyChar => "/(?s:.)/".to_string(),
            Piece::Operator(op) => op.to_string(),
            Piece::Repeat(repeat) => repeat.clone(),
        });
        i += 1;
    }
    if !rules.iter().any(|(name, _)| name == "start") {
        return Err(invalid("no `root` rule"));
    }
    if let Some((name, _)) = rules.iter().find(|(_, body)| body.is_empty()) {
        return Err(invalid(&format!("rule `{name}` is empty")));
    }
    Ok(rules
        .iter()
        .map(|(name, body)| format!("{name}: {}\n", body.join(" ")))
        .collect())
}

fn invalid(message: &str) -> GrammarError {
    GrammarError::InvalidConstraint {
        kind: "ebnf",
        message: message.to_string(),
    }
}

fn rule_name(name: &str) -> String {
    if name == "root" {
        "start".to_string()
    } else {
        format!("r_{}", name.to_ascii_lowercase().replace('-', "_"))
    }
}

fn lex(source: &str) -> Result<Vec<Piece>, GrammarError> {
    let chars: Vec<char> = source.chars().collect();
    let mut pieces = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        match c {
            _ if c.is_whitespace() => i += 1,
            '#' => {
                while i < chars.len() && chars[i] != '\n' {
                    i += 1;
                }
            }
            ':' if chars[i..].starts_with(&[':', ':', '=']) => {
                pieces.push(Piece::Defines);
                i += 3;
            }
            '"' => {
                let end = closing(&chars, i, '"')
                    .ok_or_else(|| invalid(&format!("unterminated string at character {i}")))?;
                pieces.push(Piece::Literal(chars[i..=end].iter().collect()));
                i = end + 1;
            }
            '[' => {
                let end = closing(&chars, i, ']').ok_or_else(|| {
                    invalid(&format!("unterminated character class at character {i}"))
                })?;
                pieces.push(Piece::Class(chars[i..=end].iter().collect()));
                i = end + 1;
            }
            '{' => {
                let end = chars[i..]
                    .iter()
                    .position(|&c| c == '}')
                    .map(|n| i + n)
                    .ok_or_else(|| invalid(&format!("unterminated repetition at character {i}")))?;
                let repeat: String = chars[i..=end]
                    .iter()
                    .filter(|c| !c.is_whitespace())
                    .collect();
                if !repeat[1..repeat.len() - 1]
                    .chars()
                    .all(|c| c.is_ascii_digit() || c == ',')
                {
                    return Err(invalid(&format!("bad repetition {repeat}")));
                }
                pieces.push(Piece::Repeat(repeat));
                i = end + 1;
            }
            '.' => {
                pieces.push(Piece::AnyChar);
                i += 1;
            }
            '|' | '*' | '+' | '?' | '(' | ')' => {
                pieces.push(Piece::Operator(c));
                i += 1;
            }
            _ if c.is_ascii_alphanumeric() || c == '-' || c == '_' => {
                let start = i;
                while i < chars.len()
                    && (chars[i].is_ascii_alphanumeric() || chars[i] == '-' || chars[i] == '_')
                {
                    i += 1;
                }
                pieces.push(Piece::Name(chars[start..i].iter().collect()));
            }
            _ => return Err(invalid(&format!("unexpected {c:?} at character {i}"))),
        }
    }
    Ok(pieces)
}

/// Index of the `close` that ends the literal or class opened at `open`, skipping `\` escapes.
fn closing(chars: &[char], open: usize, close: char) -> Option<usize> {
    let mut i = open + 1;
    // `[]...]` and `[^]...]` are not special in GBNF; a `]` right after `[` closes nothing here.
    while i < chars.len() {
        match chars[i] {
            '\\' => i += 2,
            c if c == close => return Some(i),
            _ => i += 1,
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn translates_rules_classes_literals_and_repeats() {
        let gbnf = "# answer\nroot ::= greeting \" \" name-part{1,2}\ngreeting ::= \"hi\" | \"hello\"\n\
                    name-part ::= [A-Z] [a-z/]* (\",\" .)?\n";
        let lark = ebnf_to_lark(gbnf).unwrap();
        assert_eq!(
            lark,
            "start: r_greeting \" \" r_name_part {1,2}\n\
             r_greeting: \"hi\" | \"hello\"\n\
             r_name_part: /[A-Z]/ /[a-z\\/]/ * ( \",\" /(?s:.)/ ) ?\n"
        );
    }

    #[test]
    fn multi_line_rules_become_one_line() {
        let lark = ebnf_to_lark("root ::= (\n  \"a\" |\n  \"b\\\"\"\n)").unwrap();
        assert_eq!(lark, "start: ( \"a\" | \"b\\\"\" )\n");
    }

    #[test]
    fn malformed_grammars_are_errors() {
        for bad in [
            "",
            "x ::= \"a\"",
            "root ::= \"a",
            "root ::= [a-z",
            "root ::= \"a\"{1,x}",
            "\"a\" root ::= \"b\"",
            "root ::=",
            "root ::= \"a\" ; ",
        ] {
            let err = ebnf_to_lark(bad).unwrap_err();
            assert!(
                matches!(err, GrammarError::InvalidConstraint { kind: "ebnf", .. }),
                "{bad:?}: {err}"
            );
        }
    }
}
