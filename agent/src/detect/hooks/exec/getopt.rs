//! A getopt_long(3) reader: GNU argument permutation, `--` ending options,
//! clustered short options, `--name=value`, unambiguous long-name prefixes.

#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Val {
    No,
    Req,
    Opt,
}

pub(super) struct Spec {
    /// getopt(3) style: a letter followed by ':' takes a value, by "::" an optional one.
    pub(super) short: &'static str,
    pub(super) long: &'static [(&'static str, Val)],
    /// Skip unknown long options instead of refusing them.
    pub(super) lenient_long: bool,
}

pub(super) enum Long {
    Found(&'static str, Val),
    Unknown,
    Ambiguous,
}

impl Spec {
    pub(super) fn short(&self, c: u8) -> Option<Val> {
        let s = self.short.as_bytes();
        let i = s.iter().position(|&b| b == c && c != b':')?;
        Some(match (s.get(i + 1), s.get(i + 2)) {
            (Some(b':'), Some(b':')) => Val::Opt,
            (Some(b':'), _) => Val::Req,
            _ => Val::No,
        })
    }

    pub(super) fn long(&self, name: &[u8]) -> Long {
        if name.is_empty() {
            return Long::Unknown;
        }
        if let Some(&(n, v)) = self.long.iter().find(|(n, _)| n.as_bytes() == name) {
            return Long::Found(n, v);
        }
        let mut hits = self
            .long
            .iter()
            .filter(|(n, _)| n.as_bytes().starts_with(name));
        match (hits.next(), hits.next()) {
            (Some(&(n, v)), None) => Long::Found(n, v),
            (None, _) => Long::Unknown,
            _ => Long::Ambiguous,
        }
    }
}

#[derive(Debug, PartialEq, Eq)]
pub(super) enum Tok<'a> {
    Short(u8, Option<&'a [u8]>),
    Long(&'static str, Option<&'a [u8]>),
    /// A non-option argument and its index in the arguments.
    Pos(usize, &'a [u8]),
    /// An unknown or ambiguous option, a missing value, a value given to a flag.
    Bad,
}

pub(super) fn tokenize<'a>(args: &[&'a [u8]], spec: &Spec) -> Vec<Tok<'a>> {
    let mut toks = Vec::new();
    let mut i = 0;
    while let Some(&arg) = args.get(i) {
        i += 1;
        if arg == b"--" {
            toks.extend(
                args.iter()
                    .enumerate()
                    .skip(i)
                    .map(|(j, &a)| Tok::Pos(j, a)),
            );
            break;
        }
        if let Some(body) = arg.strip_prefix(b"--") {
            let (name, inline) = match body.iter().position(|&b| b == b'=') {
                Some(eq) => (&body[..eq], Some(&body[eq + 1..])),
                None => (body, None),
            };
            let tok = match (spec.long(name), inline) {
                (Long::Found(n, Val::No), None) => Tok::Long(n, None),
                (Long::Found(_, Val::No), Some(_)) => Tok::Bad,
                (Long::Found(n, Val::Opt), value) => Tok::Long(n, value),
                (Long::Found(n, Val::Req), Some(value)) => Tok::Long(n, Some(value)),
                (Long::Found(n, Val::Req), None) => match args.get(i) {
                    Some(&value) => {
                        i += 1;
                        Tok::Long(n, Some(value))
                    }
                    None => Tok::Bad,
                },
                (Long::Unknown, _) if spec.lenient_long => continue,
                (Long::Unknown | Long::Ambiguous, _) => Tok::Bad,
            };
            toks.push(tok);
        } else if arg.len() > 1 && arg[0] == b'-' {
            for (j, &c) in arg.iter().enumerate().skip(1) {
                let rest = &arg[j + 1..];
                match spec.short(c) {
                    None => toks.push(Tok::Bad),
                    Some(Val::No) => {
                        toks.push(Tok::Short(c, None));
                        continue;
                    }
                    Some(Val::Opt) => toks.push(Tok::Short(c, (!rest.is_empty()).then_some(rest))),
                    Some(Val::Req) if !rest.is_empty() => toks.push(Tok::Short(c, Some(rest))),
                    Some(Val::Req) => match args.get(i) {
                        Some(&value) => {
                            i += 1;
                            toks.push(Tok::Short(c, Some(value)));
                        }
                        None => toks.push(Tok::Bad),
                    },
                }
                break;
            }
        } else {
            toks.push(Tok::Pos(i - 1, arg));
        }
    }
    toks
}
