//! The commands and YAML the docs show, as a reader would copy them: the
//! lines of ```sh blocks (continuations joined, comments dropped), split
//! into words as a shell would, and the ```yaml blocks.
use std::path::{Path, PathBuf};

/// One command of a doc, with where it is.
#[derive(Clone, Debug)]
pub struct DocCommand {
    pub file: PathBuf,
    pub line: usize,
    pub words: Vec<String>,
}

impl std::fmt::Display for DocCommand {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}:{}: {}",
            self.file.display(),
            self.line,
            self.words.join(" ")
        )
    }
}

/// Every fenced block of `text` whose info string is `lang`, with the line
/// of its first content line (1-based).
pub fn blocks(text: &str, lang: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    let mut current: Option<(usize, String)> = None;
    for (i, l) in text.lines().enumerate() {
        if let Some(info) = l.strip_prefix("```") {
            match current.take() {
                Some(b) => out.push(b),
                None if info.trim() == lang => current = Some((i + 2, String::new())),
                None => current = Some((0, String::new())),
            }
            continue;
        }
        if let Some((_, body)) = current.as_mut() {
            body.push_str(l);
            body.push('\n');
        }
    }
    out.into_iter().filter(|(line, _)| *line > 0).collect()
}

/// The commands of the ```sh blocks of `file`.
pub fn commands(file: &Path) -> Vec<DocCommand> {
    let text = std::fs::read_to_string(file).unwrap();
    let mut out = Vec::new();
    for (first, body) in blocks(&text, "sh") {
        let mut joined = String::new();
        let mut start = first;
        for (i, l) in body.lines().enumerate() {
            if joined.is_empty() {
                start = first + i;
            }
            match l.trim_end().strip_suffix('\\') {
                Some(cont) => {
                    joined.push_str(cont);
                    joined.push(' ');
                }
                None => {
                    joined.push_str(l);
                    let words = words(&joined);
                    if !words.is_empty() {
                        out.push(DocCommand {
                            file: file.to_path_buf(),
                            line: start,
                            words,
                        });
                    }
                    joined.clear();
                }
            }
        }
    }
    out
}

/// Shell words: whitespace-separated, quotes grouping and removed, a `#`
/// that starts a word ending the line.
pub fn words(line: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut word = String::new();
    let mut in_word = false;
    let mut quote: Option<char> = None;
    for c in line.chars() {
        match (quote, c) {
            (Some(q), c) if c == q => quote = None,
            (Some(_), c) => word.push(c),
            (None, '\'' | '"') => {
                quote = Some(c);
                in_word = true;
            }
            (None, '#') if !in_word => break,
            (None, c) if c.is_whitespace() => {
                if in_word {
                    out.push(std::mem::take(&mut word));
                    in_word = false;
                }
            }
            (None, c) => {
                word.push(c);
                in_word = true;
            }
        }
    }
    if in_word {
        out.push(word);
    }
    out
}

/// A documented word with its placeholders filled as the tests run it
/// (`REGISTRY`: a registry name no node would pull from).
pub fn filled(word: &str) -> String {
    word.replace("REGISTRY", "registry.example")
}

/// README.md and every docs/*.md.
pub fn doc_files() -> Vec<PathBuf> {
    let root = crate::render::repo();
    let mut files = vec![
        root.join("README.md"),
        root.join("deploy/helm/lastgasp/README.md"),
        root.join("tests/testing-log.md"),
    ];
    let mut docs: Vec<PathBuf> = std::fs::read_dir(root.join("docs"))
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "md"))
        .collect();
    docs.sort();
    files.extend(docs);
    files
}

/// The words after `flag` (`-n x`, `--namespace x`), if any.
pub fn flag<'a>(words: &'a [String], names: &[&str]) -> Option<&'a str> {
    words
        .windows(2)
        .find(|w| names.contains(&w[0].as_str()))
        .map(|w| w[1].as_str())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn words_are_split_as_a_shell_would() {
        assert_eq!(
            words(r#"kubectl get node N -o jsonpath='{.a[?(@.type=="X")]}'   # a comment"#),
            [
                "kubectl",
                "get",
                "node",
                "N",
                "-o",
                r#"jsonpath={.a[?(@.type=="X")]}"#
            ]
        );
        assert_eq!(words("a#b # c"), ["a#b"]);
        assert!(words("# only a comment").is_empty());
    }

    #[test]
    fn continuations_join_and_blocks_are_found_by_language() {
        let dir = std::env::temp_dir().join(format!("doccmd-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("x.md");
        std::fs::write(&f, "text\n```sh\na b \\\n  c\nd\n```\n```yaml\nk: v\n```\n").unwrap();
        let c = commands(&f);
        assert_eq!(c.len(), 2);
        assert_eq!(
            (c[0].line, c[0].words.clone()),
            (3, vec!["a".into(), "b".into(), "c".into()])
        );
        assert_eq!(c[1].words, ["d"]);
        assert_eq!(
            blocks(&std::fs::read_to_string(&f).unwrap(), "yaml"),
            [(8, "k: v\n".to_string())]
        );
        std::fs::remove_dir_all(&dir).ok();
    }
}
