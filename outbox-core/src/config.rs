//! Connection URLs, parsed the same way for every backend.
//!
//! Every adapter is configured by one URL, and a command-line program picks the backend from it.
//! When each adapter parsed its own URL, they disagreed: one percent-decoded the password and
//! another did not, one ignored a misspelt `outbox_*` parameter and silently used the default,
//! one printed the password in an error. A single parser gives one set of rules:
//!
//! - the scheme is checked against the backend's list, and every error names the backend and
//!   shows the URL with its password replaced by `***` (text that is not a URL at all is not
//!   shown);
//! - user, password, hosts and path are percent-decoded, and a malformed escape is an error, not
//!   a literal `%`;
//! - parameters named `outbox_*` belong to the outbox and never reach the driver; the rest are
//!   the driver's. An `outbox_*` parameter the backend does not know is an error that lists the
//!   known ones, so a typo cannot fall back to a default;
//! - the driver gets the URL back without the `outbox_*` parameters, byte for byte otherwise.
//!
//! [`env_url`] reads a URL from the environment with no fallback: a library that quietly
//! connects to a local test server when a variable is missing turns a deployment mistake into
//! writes to the wrong database.

use std::any::Any;
use std::borrow::Cow;
use std::collections::BTreeSet;
use std::fmt;
use std::num::{IntErrorKind, ParseIntError};
use std::str::FromStr;
use std::time::Duration;

use percent_encoding::{AsciiSet, NON_ALPHANUMERIC, percent_decode_str, utf8_percent_encode};

use crate::error::{Error, Result};

/// The prefix of the parameters that belong to the outbox rather than to the driver.
pub const OUTBOX_PARAM_PREFIX: &str = "outbox_";

/// What replaces a secret in redacted text.
pub const REDACTED: &str = "***";

/// What [`redact`] returns for text it cannot read as a URL (it cannot tell where a secret
/// would be, so it shows none of it).
pub const HIDDEN_URL: &str = "<unparsable URL, not shown>";

/// Query parameter names whose value is a secret: a name containing one of these
/// (case-insensitive) is redacted.
const SECRET_PARAM_MARKERS: &[&str] =
    &["password", "passwd", "secret", "token", "credential", "ssl.key", "private_key", "apikey", "api_key"];

/// What a backend accepts as a connection URL.
///
/// ```
/// use outbox_core::config::UrlSpec;
///
/// const POSTGRES: UrlSpec = UrlSpec::new("postgres", &["postgres", "postgresql"]);
/// const KAFKA: UrlSpec = UrlSpec::new("kafka", &["kafka", "kafka+ssl"]).multi_host();
/// const SQLITE: UrlSpec = UrlSpec::new("sqlite", &["sqlite"]).path_only();
/// # let _ = (POSTGRES, KAFKA, SQLITE);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UrlSpec {
    backend: &'static str,
    schemes: &'static [&'static str],
    multi_host: bool,
    path_only: bool,
}

impl UrlSpec {
    /// URLs of `backend` (the name errors carry) with one of `schemes` (lower case, without
    /// `://`), in the form `scheme://[user[:password]@]host[:port][/path][?query][#fragment]`
    /// with at most one host.
    pub const fn new(backend: &'static str, schemes: &'static [&'static str]) -> Self {
        Self { backend, schemes, multi_host: false, path_only: false }
    }

    /// Accept a comma-separated host list (`kafka://h1:9092,h2:9092`).
    #[must_use]
    pub const fn multi_host(mut self) -> Self {
        self.multi_host = true;
        self
    }

    /// The URL has no authority: everything after `scheme:` (and an optional `//`) up to the
    /// query is the path (`sqlite:///abs/file.db`, `sqlite:rel/file.db`, `sqlite://rel/file.db`).
    #[must_use]
    pub const fn path_only(mut self) -> Self {
        self.path_only = true;
        self
    }

    /// The backend name errors carry.
    pub fn backend(&self) -> &'static str {
        self.backend
    }

    /// The accepted schemes.
    pub fn schemes(&self) -> &'static [&'static str] {
        self.schemes
    }

    fn expected_schemes(&self) -> String {
        let sep = if self.path_only { ":" } else { "://" };
        let forms: Vec<String> = self.schemes.iter().map(|s| format!("{s}{sep}")).collect();
        match forms.as_slice() {
            [] => "no scheme".to_string(),
            [one] => one.clone(),
            [init @ .., last] => format!("{} or {last}", init.join(", ")),
        }
    }
}

/// One host of a URL, percent-decoded; an IPv6 address is given without its brackets.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct HostPort {
    host: String,
    port: Option<u16>,
}

impl HostPort {
    /// The host name or address (`::1`, not `[::1]`).
    pub fn host(&self) -> &str {
        &self.host
    }

    /// The port, if the URL gives one.
    pub fn port(&self) -> Option<u16> {
        self.port
    }

    /// The port, or `default` when the URL gives none.
    pub fn port_or(&self, default: u16) -> u16 {
        self.port.unwrap_or(default)
    }

    /// `host:port` (`[v6]:port` for an IPv6 address), the form socket APIs and Kafka's
    /// `bootstrap.servers` take.
    pub fn with_port(&self, default: u16) -> String {
        HostPort { host: self.host.clone(), port: Some(self.port_or(default)) }.to_string()
    }
}

/// `host[:port]`, with brackets around an IPv6 address.
impl fmt::Display for HostPort {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.host.contains(':') {
            write!(f, "[{}]", self.host)?;
        } else {
            f.write_str(&self.host)?;
        }
        if let Some(port) = self.port {
            write!(f, ":{port}")?;
        }
        Ok(())
    }
}

/// A parsed connection URL: its decoded parts, the driver's parameters, and the `outbox_*`
/// parameters still to be read by the backend.
///
/// The backend reads its `outbox_*` parameters with the typed accessors (`outbox_str`,
/// `outbox_u32`, `outbox_duration_ms`, ...), each of which also records the name as known, then
/// calls [`finish`](Self::finish), which fails on any `outbox_*` parameter nobody read.
///
/// ```
/// use std::time::Duration;
/// use outbox_core::config::{ConnectionUrl, UrlSpec};
///
/// const SPEC: UrlSpec = UrlSpec::new("postgres", &["postgres", "postgresql"]);
/// let mut url = ConnectionUrl::parse(
///     &SPEC,
///     "postgres://app:p%40ss@db:5432/orders?sslmode=require&outbox_pool_size=4&outbox_lock_timeout_ms=250",
/// )?;
/// assert_eq!(url.password(), Some("p@ss"));
/// assert_eq!(url.outbox_u32("outbox_pool_size")?, Some(4));
/// assert_eq!(url.outbox_duration_ms("outbox_lock_timeout_ms")?, Some(Duration::from_millis(250)));
/// url.finish()?;
/// assert_eq!(url.driver_url(), "postgres://app:p%40ss@db:5432/orders?sslmode=require");
/// assert_eq!(url.to_string(), "postgres://app:***@db:5432/orders?sslmode=require&outbox_pool_size=4&outbox_lock_timeout_ms=250");
/// # Ok::<(), outbox_core::Error>(())
/// ```
///
/// `Debug` and `Display` show the URL redacted (see [`redact`]); only
/// [`driver_url`](Self::driver_url) and [`password`](Self::password) give the secret back.
#[derive(Clone)]
pub struct ConnectionUrl {
    spec: UrlSpec,
    redacted: String,
    scheme: String,
    user: Option<String>,
    password: Option<String>,
    hosts: Vec<HostPort>,
    raw_path: String,
    path: String,
    fragment: Option<String>,
    /// Everything before the query (and fragment), as given: the driver URL's base.
    base: String,
    /// The driver's parameters, as given (for the driver URL).
    driver_query: Vec<String>,
    /// The driver's parameters, decoded.
    params: Vec<(String, String)>,
    /// The `outbox_*` parameters, decoded.
    outbox: Vec<(String, String)>,
    /// Every `outbox_*` name the backend asked for.
    known: BTreeSet<String>,
}

impl ConnectionUrl {
    /// Parse `raw` as a URL of `spec`'s backend.
    ///
    /// # Errors
    /// [`ErrorKind::Config`](crate::ErrorKind::Config) (permanent), naming the backend and
    /// showing the URL redacted, when the text has no scheme or one `spec` does not accept,
    /// contains whitespace or control characters, has a malformed percent-escape or a part that
    /// is not UTF-8 once decoded, a bad port, an empty host in a list, several hosts where one is
    /// expected, or the same `outbox_*` parameter twice.
    pub fn parse(spec: &UrlSpec, raw: &str) -> Result<Self> {
        let redacted = redact(raw);
        let fail = |why: String| Error::config(spec.backend, format!("bad URL {redacted}: {why}"));
        if raw.chars().any(|c| c.is_whitespace() || c.is_control()) {
            return Err(fail("it contains whitespace or a control character".into()));
        }
        let Some((scheme, rest)) = split_scheme(raw) else {
            return Err(fail(format!("it has no scheme (expected {})", spec.expected_schemes())));
        };
        let scheme = scheme.to_ascii_lowercase();
        if !spec.schemes.contains(&scheme.as_str()) {
            return Err(fail(format!("the scheme {scheme:?} is not accepted (expected {})", spec.expected_schemes())));
        }
        let (before_fragment, fragment) = match rest.split_once('#') {
            Some((b, f)) => (b, Some(f.to_string())),
            None => (rest, None),
        };
        let (hier, query) = before_fragment.split_once('?').unwrap_or((before_fragment, ""));
        let base = raw[..raw.len() - rest.len() + hier.len()].to_string();

        let mut url = Self {
            spec: *spec,
            redacted: redacted.clone(),
            scheme,
            user: None,
            password: None,
            hosts: Vec::new(),
            raw_path: String::new(),
            path: String::new(),
            fragment,
            base,
            driver_query: Vec::new(),
            params: Vec::new(),
            outbox: Vec::new(),
            known: BTreeSet::new(),
        };

        if spec.path_only {
            url.raw_path = hier.strip_prefix("//").unwrap_or(hier).to_string();
        } else {
            let Some(after_slashes) = hier.strip_prefix("//") else {
                return Err(fail(format!("expected {}host...", spec.expected_schemes())));
            };
            let (authority, path) = match after_slashes.find('/') {
                Some(i) => after_slashes.split_at(i),
                None => (after_slashes, ""),
            };
            url.raw_path = path.to_string();
            let (userinfo, host_list) = match authority.rsplit_once('@') {
                Some((u, h)) => (Some(u), h),
                None => (None, authority),
            };
            if let Some(userinfo) = userinfo {
                let (user, password) = match userinfo.split_once(':') {
                    Some((u, p)) => (u, Some(p)),
                    None => (userinfo, None),
                };
                url.user = Some(decode(user, false).map_err(|why| fail(format!("the user name {why}")))?);
                url.password = match password {
                    Some(p) => Some(decode(p, false).map_err(|why| fail(format!("the password {why}")))?),
                    None => None,
                };
            }
            if !host_list.is_empty() {
                let entries: Vec<&str> = host_list.split(',').collect();
                if entries.len() > 1 && !spec.multi_host {
                    return Err(fail(format!(
                        "it names {} hosts; the {} backend connects to one",
                        entries.len(),
                        spec.backend
                    )));
                }
                for entry in entries {
                    url.hosts.push(parse_host_port(entry).map_err(fail)?);
                }
            }
        }
        url.path = decode(&url.raw_path, false).map_err(|why| fail(format!("the path {why}")))?;

        for piece in query.split('&').filter(|p| !p.is_empty()) {
            let (raw_key, raw_value) = piece.split_once('=').unwrap_or((piece, ""));
            let key = decode(raw_key, true).map_err(|why| fail(format!("a parameter name {why}")))?;
            let value = decode(raw_value, true).map_err(|why| {
                let shown = if is_secret_param(&key) { REDACTED.to_string() } else { format!("{key:?}") };
                fail(format!("the value of parameter {shown} {why}"))
            })?;
            if is_outbox_param(&key) {
                if url.outbox.iter().any(|(k, _)| *k == key) {
                    return Err(fail(format!("the parameter {key} is given more than once")));
                }
                url.outbox.push((key, value));
            } else {
                url.driver_query.push(piece.to_string());
                url.params.push((key, value));
            }
        }
        Ok(url)
    }

    /// The backend this URL is for.
    pub fn backend(&self) -> &'static str {
        self.spec.backend
    }

    /// The scheme, in lower case (`postgres`, `kafka+ssl`).
    pub fn scheme(&self) -> &str {
        &self.scheme
    }

    /// The decoded user name; `None` when the URL has no user info at all (`Some("")` for
    /// `scheme://:password@host`).
    pub fn user(&self) -> Option<&str> {
        self.user.as_deref()
    }

    /// The decoded password; `None` when the URL gives none.
    pub fn password(&self) -> Option<&str> {
        self.password.as_deref()
    }

    /// The hosts, decoded, in URL order (empty for `scheme:///path` and path-only URLs).
    pub fn hosts(&self) -> &[HostPort] {
        &self.hosts
    }

    /// The first host, if any.
    pub fn host(&self) -> Option<&HostPort> {
        self.hosts.first()
    }

    /// The first host.
    ///
    /// # Errors
    /// [`ErrorKind::Config`](crate::ErrorKind::Config) when the URL has no host.
    pub fn require_host(&self) -> Result<&HostPort> {
        self.host().ok_or_else(|| self.error("it has no host"))
    }

    /// The decoded path, with its leading `/` (empty when the URL has none).
    pub fn path(&self) -> &str {
        &self.path
    }

    /// The path as written, still percent-encoded.
    pub fn raw_path(&self) -> &str {
        &self.raw_path
    }

    /// The fragment as written (after `#`), if any.
    pub fn fragment(&self) -> Option<&str> {
        self.fragment.as_deref()
    }

    /// The driver's parameters (every query parameter not named `outbox_*`), decoded, in URL
    /// order.
    pub fn params(&self) -> &[(String, String)] {
        &self.params
    }

    /// The value of the driver's parameter `name` (its first occurrence).
    pub fn param(&self, name: &str) -> Option<&str> {
        self.params.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
    }

    /// The URL for the driver: as given, without the `outbox_*` parameters.
    ///
    /// It still holds the password: do not log it (log [`redacted`](Self::redacted)).
    pub fn driver_url(&self) -> String {
        let mut out = self.base.clone();
        if !self.driver_query.is_empty() {
            out.push('?');
            out.push_str(&self.driver_query.join("&"));
        }
        if let Some(fragment) = &self.fragment {
            out.push('#');
            out.push_str(fragment);
        }
        out
    }

    /// The whole URL as given, redacted (see [`redact`]).
    pub fn redacted(&self) -> &str {
        &self.redacted
    }

    /// A configuration error about this URL: names the backend and shows the URL redacted.
    pub fn error(&self, why: impl fmt::Display) -> Error {
        Error::config(self.spec.backend, format!("bad URL {}: {why}", self.redacted))
    }

    /// A configuration error about the parameter `name` with `value` (shown as `***` when the
    /// name says it is a secret).
    pub fn param_error(&self, name: &str, value: &str, why: impl fmt::Display) -> Error {
        let value = if is_secret_param(name) { REDACTED.to_string() } else { format!("{value:?}") };
        Error::config(self.spec.backend, format!("URL parameter {name}={value}: {why}"))
    }

    /// The error for a parameter this backend does not know, listing the known `outbox_*` ones
    /// (those asked for so far) and `also` (e.g. "or a librdkafka property such as linger.ms").
    pub fn unknown_param_error(&self, name: &str, also: &str) -> Error {
        let known = self.known_params();
        let mut list = if known.is_empty() { "none".to_string() } else { known.join(", ") };
        if !also.is_empty() {
            list = format!("{list}; {also}");
        }
        Error::config(self.spec.backend, format!("unknown URL parameter {name:?} (known: {list})"))
    }

    /// Fail on any driver parameter: for backends whose driver takes none from the URL.
    ///
    /// # Errors
    /// [`unknown_param_error`](Self::unknown_param_error) for the first one.
    pub fn reject_driver_params(&self) -> Result<()> {
        self.reject_driver_params_except(|_| false, "")
    }

    /// Fail on a driver parameter that `accepted` does not take: for backends whose driver would
    /// ignore an unknown one (with a log line at best) instead of refusing it. `also` lists the
    /// driver's parameters in the error, as in [`unknown_param_error`](Self::unknown_param_error).
    ///
    /// # Errors
    /// [`unknown_param_error`](Self::unknown_param_error) for the first one not accepted.
    pub fn reject_driver_params_except(&self, accepted: impl Fn(&str) -> bool, also: &str) -> Result<()> {
        match self.params.iter().find(|(name, _)| !accepted(name)) {
            Some((name, _)) => Err(self.unknown_param_error(name, also)),
            None => Ok(()),
        }
    }

    /// The `outbox_*` parameters, decoded, in URL order, whether read yet or not.
    pub fn outbox_params(&self) -> &[(String, String)] {
        &self.outbox
    }

    /// The `outbox_*` names the backend asked for so far, sorted.
    pub fn known_params(&self) -> Vec<&str> {
        self.known.iter().map(String::as_str).collect()
    }

    /// Check that every `outbox_*` parameter of the URL was read.
    ///
    /// # Errors
    /// [`ErrorKind::Config`](crate::ErrorKind::Config) naming the first unknown one and listing
    /// the known ones.
    pub fn finish(&self) -> Result<()> {
        match self.outbox.iter().find(|(k, _)| !self.known.contains(k)) {
            Some((name, _)) => Err(self.unknown_param_error(name, "")),
            None => Ok(()),
        }
    }

    fn take(&mut self, name: &str) -> Option<String> {
        debug_assert!(name.starts_with(OUTBOX_PARAM_PREFIX), "{name} is not an outbox_* parameter");
        self.known.insert(name.to_string());
        self.outbox.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone())
    }

    /// The `outbox_*` parameter `name` as text (possibly empty).
    pub fn outbox_str(&mut self, name: &str) -> Option<String> {
        self.take(name)
    }

    /// The `outbox_*` parameter `name` parsed with `T`'s `FromStr` (enumerations such as a
    /// durability mode).
    ///
    /// # Errors
    /// [`ErrorKind::Config`](crate::ErrorKind::Config) naming the parameter, the value and
    /// `T`'s reason.
    pub fn outbox_parse<T>(&mut self, name: &str) -> Result<Option<T>>
    where
        T: FromStr,
        T::Err: fmt::Display + 'static,
    {
        let Some(value) = self.take(name) else { return Ok(None) };
        value.parse().map(Some).map_err(|e: T::Err| {
            // An outbox error already names its backend; show only its message.
            let why = match (&e as &dyn Any).downcast_ref::<Error>() {
                Some(inner) => inner.message().to_string(),
                None => e.to_string(),
            };
            self.param_error(name, &value, why)
        })
    }

    /// The `outbox_*` parameter `name` as a whole number of type `T`.
    ///
    /// # Errors
    /// [`ErrorKind::Config`](crate::ErrorKind::Config) naming the parameter and the value when
    /// it is empty, not a whole number, or out of `T`'s range.
    pub fn outbox_number<T>(&mut self, name: &str) -> Result<Option<T>>
    where
        T: FromStr<Err = ParseIntError>,
    {
        let Some(value) = self.take(name) else { return Ok(None) };
        value.parse().map(Some).map_err(|e: ParseIntError| {
            let why = match e.kind() {
                IntErrorKind::Empty => "expected a whole number, got nothing",
                IntErrorKind::PosOverflow => "the number is too large for this setting",
                IntErrorKind::NegOverflow => "the number is too small for this setting",
                _ => "expected a whole number",
            };
            self.param_error(name, &value, why)
        })
    }

    /// [`outbox_number`](Self::outbox_number) as `u64`.
    ///
    /// # Errors
    /// As [`outbox_number`](Self::outbox_number).
    pub fn outbox_u64(&mut self, name: &str) -> Result<Option<u64>> {
        self.outbox_number(name)
    }

    /// [`outbox_number`](Self::outbox_number) as `u32`.
    ///
    /// # Errors
    /// As [`outbox_number`](Self::outbox_number).
    pub fn outbox_u32(&mut self, name: &str) -> Result<Option<u32>> {
        self.outbox_number(name)
    }

    /// [`outbox_number`](Self::outbox_number) as `usize`.
    ///
    /// # Errors
    /// As [`outbox_number`](Self::outbox_number).
    pub fn outbox_usize(&mut self, name: &str) -> Result<Option<usize>> {
        self.outbox_number(name)
    }

    /// The `outbox_*` parameter `name` (by convention ending in `_ms`) as a whole number of
    /// milliseconds.
    ///
    /// # Errors
    /// As [`outbox_number`](Self::outbox_number).
    pub fn outbox_duration_ms(&mut self, name: &str) -> Result<Option<Duration>> {
        debug_assert!(name.ends_with("_ms"), "{name}: a duration parameter ends in _ms");
        Ok(self.outbox_number::<u64>(name)?.map(Duration::from_millis))
    }

    /// The `outbox_*` parameter `name` as a boolean: `true`/`false`, `1`/`0`, `yes`/`no`,
    /// `on`/`off` (any case).
    ///
    /// # Errors
    /// [`ErrorKind::Config`](crate::ErrorKind::Config) naming the parameter and the value for
    /// anything else.
    pub fn outbox_bool(&mut self, name: &str) -> Result<Option<bool>> {
        let Some(value) = self.take(name) else { return Ok(None) };
        match value.to_ascii_lowercase().as_str() {
            "true" | "1" | "yes" | "on" => Ok(Some(true)),
            "false" | "0" | "no" | "off" => Ok(Some(false)),
            _ => Err(self.param_error(name, &value, "expected `true` or `false`")),
        }
    }
}

impl fmt::Display for ConnectionUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.redacted)
    }
}

impl fmt::Debug for ConnectionUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ConnectionUrl")
            .field("backend", &self.spec.backend)
            .field("url", &self.redacted)
            .field("user", &self.user)
            .field("password", &self.password.as_ref().map(|_| REDACTED))
            .field("hosts", &self.hosts)
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

/// Whether `key` is an `outbox_*` parameter name (the prefix in any case, so that
/// `OUTBOX_POOL_SIZE` is reported as unknown instead of reaching the driver).
pub fn is_outbox_param(key: &str) -> bool {
    key.get(..OUTBOX_PARAM_PREFIX.len()).is_some_and(|p| p.eq_ignore_ascii_case(OUTBOX_PARAM_PREFIX))
}

/// Whether the value of the query parameter (or driver option) `key` is a secret: its name
/// contains `password`, `passwd`, `secret`, `token`, `credential`, `ssl.key`, `private_key`,
/// `apikey` or `api_key`, in any case (`password`, `sasl.password`, `client_secret`, ...).
pub fn is_secret_param(key: &str) -> bool {
    let key = key.to_ascii_lowercase();
    SECRET_PARAM_MARKERS.iter().any(|m| key.contains(m))
}

/// `url` with the password of its user info and the values of secret parameters (see
/// [`is_secret_param`], in the query and the fragment) replaced by `***`.
///
/// It does not need the URL to be valid, so that an error about a malformed URL can still show
/// it: it only needs a scheme. Text without one, or without `//` but with an `@` (a password
/// may be in there), is replaced by [`HIDDEN_URL`] entirely. When the user info is ambiguous
/// (an `@` in the path) it hides more rather than less.
///
/// ```
/// use outbox_core::config::redact;
///
/// assert_eq!(redact("amqp://guest:p%40ss@rabbit/%2f?heartbeat=5"), "amqp://guest:***@rabbit/%2f?heartbeat=5");
/// assert_eq!(redact("postgres://db/app?password=hunter2&sslmode=require"), "postgres://db/app?password=***&sslmode=require");
/// assert_eq!(redact("user:hunter2@db:5432"), "<unparsable URL, not shown>");
/// ```
pub fn redact(url: &str) -> String {
    let Some((scheme, rest)) = split_scheme(url) else { return HIDDEN_URL.to_string() };
    let (before_fragment, fragment) = match rest.split_once('#') {
        Some((b, f)) => (b, Some(f)),
        None => (rest, None),
    };
    let (hier, query) = match before_fragment.split_once('?') {
        Some((h, q)) => (h, Some(q)),
        None => (before_fragment, None),
    };
    let mut out = format!("{scheme}:");
    match hier.strip_prefix("//") {
        Some(after) => {
            out.push_str("//");
            match after.rfind('@') {
                Some(at) => {
                    let userinfo = &after[..at];
                    match userinfo.split_once(':') {
                        Some((user, _)) => {
                            out.push_str(user);
                            out.push(':');
                            out.push_str(REDACTED);
                        }
                        None => out.push_str(userinfo),
                    }
                    out.push_str(&after[at..]);
                }
                None => out.push_str(after),
            }
        }
        None if hier.contains('@') => return HIDDEN_URL.to_string(),
        None => out.push_str(hier),
    }
    if let Some(query) = query {
        out.push('?');
        out.push_str(&redact_pairs(query));
    }
    if let Some(fragment) = fragment {
        out.push('#');
        out.push_str(&redact_pairs(fragment));
    }
    out
}

/// Read the URL in the environment variable `var_name` for `backend`.
///
/// There is no default: a missing variable is an error, never a local server.
///
/// # Errors
/// [`ErrorKind::Config`](crate::ErrorKind::Config) naming the variable and what it must hold
/// when it is unset or blank, or naming it when its value is not valid Unicode.
pub fn env_url(var_name: &str, backend: impl Into<Cow<'static, str>>) -> Result<String> {
    let backend = backend.into();
    match env_var(var_name, backend.clone())? {
        Some(url) => Ok(url),
        None => Err(Error::config(
            backend.clone(),
            format!(
                "the environment variable {var_name} is not set: it must hold the {backend} connection URL \
                 (there is no default server)"
            ),
        )),
    }
}

/// Read the environment variable `var_name`, trimmed; `None` when it is unset or blank.
///
/// # Errors
/// [`ErrorKind::Config`](crate::ErrorKind::Config) for `backend`, naming the variable, when its
/// value is not valid Unicode (the value is not shown: it may hold a password).
pub fn env_var(var_name: &str, backend: impl Into<Cow<'static, str>>) -> Result<Option<String>> {
    match std::env::var(var_name) {
        Ok(v) if v.trim().is_empty() => Ok(None),
        Ok(v) => Ok(Some(v.trim().to_string())),
        Err(std::env::VarError::NotPresent) => Ok(None),
        Err(std::env::VarError::NotUnicode(_)) => {
            Err(Error::config(backend, format!("the environment variable {var_name} is not valid Unicode")))
        }
    }
}

/// Bytes [`encode_path`] leaves as they are: unreserved characters, `/` and a few sub-delimiters
/// that need no escaping in a path.
const PATH_KEEP: &AsciiSet = &NON_ALPHANUMERIC
    .remove(b'/')
    .remove(b'.')
    .remove(b'_')
    .remove(b'-')
    .remove(b'~')
    .remove(b'+')
    .remove(b',')
    .remove(b'=')
    .remove(b':')
    .remove(b'@');

/// Percent-encode a file path for a path-only URL (`sqlite:///var/lib/app/outbox%20db.db`);
/// [`ConnectionUrl::path`] decodes it back.
pub fn encode_path(path: &str) -> String {
    utf8_percent_encode(path, PATH_KEEP).to_string()
}

/// The scheme of `url`, lower-cased, when it has one of the form `[A-Za-z][A-Za-z0-9+.-]*`
/// (how a program picks the backend before parsing the rest).
pub fn scheme_of(url: &str) -> Option<String> {
    split_scheme(url).map(|(scheme, _)| scheme.to_ascii_lowercase())
}

/// Split `scheme:rest` when the scheme is `[A-Za-z][A-Za-z0-9+.-]*`.
fn split_scheme(url: &str) -> Option<(&str, &str)> {
    let (scheme, rest) = url.split_once(':')?;
    let mut chars = scheme.chars();
    let valid = chars.next().is_some_and(|c| c.is_ascii_alphabetic())
        && chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'));
    valid.then_some((scheme, rest))
}

/// Strictly percent-decode `s` (a `%` must start a two-digit hex escape) into UTF-8; with
/// `form`, `+` is a space first (query strings). The error completes "the password ...".
fn decode(s: &str, form: bool) -> std::result::Result<String, String> {
    let bytes = s.as_bytes();
    for (i, b) in bytes.iter().enumerate() {
        if *b == b'%' && !(i + 2 < bytes.len() && bytes[i + 1].is_ascii_hexdigit() && bytes[i + 2].is_ascii_hexdigit())
        {
            return Err("has a `%` that does not start a percent-escape (write `%25` for `%`)".to_string());
        }
    }
    let replaced;
    let s = if form && s.contains('+') {
        replaced = s.replace('+', " ");
        replaced.as_str()
    } else {
        s
    };
    percent_decode_str(s)
        .decode_utf8()
        .map(Cow::into_owned)
        .map_err(|_| "is not UTF-8 once percent-decoded".to_string())
}

fn parse_host_port(entry: &str) -> std::result::Result<HostPort, String> {
    if entry.is_empty() {
        return Err("a host in the list is empty".to_string());
    }
    let (host, port) = if let Some(v6) = entry.strip_prefix('[') {
        let Some((addr, after)) = v6.split_once(']') else {
            return Err("an IPv6 address has no closing `]`".to_string());
        };
        if addr.is_empty()
            || !addr.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, ':' | '.' | '%' | '-' | '_'))
        {
            return Err(format!("[{addr}] is not an IPv6 address"));
        }
        let port = match after {
            "" => None,
            p => Some(p.strip_prefix(':').ok_or_else(|| format!("unexpected {p:?} after [{addr}]"))?),
        };
        (decode(addr, false).map_err(|why| format!("the host {why}"))?, port)
    } else {
        let (host, port) = match entry.rsplit_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (entry, None),
        };
        let host = decode(host, false).map_err(|why| format!("the host {why}"))?;
        if host.chars().any(|c| c.is_whitespace() || c.is_control() || "/?#@[],:".contains(c)) {
            return Err(format!("the host {host:?} is not a host name"));
        }
        (host, port)
    };
    if host.is_empty() {
        return Err(format!("{entry:?} has no host name"));
    }
    let port = match port {
        None | Some("") => None,
        Some(p) => Some(
            p.parse::<u16>()
                .ok()
                .filter(|_| p.bytes().all(|b| b.is_ascii_digit()))
                .ok_or_else(|| format!("the port {p:?} of host {host:?} is not a number from 0 to 65535"))?,
        ),
    };
    Ok(HostPort { host, port })
}

/// Redact the values of secret parameters in `a=b&c=d` text.
fn redact_pairs(text: &str) -> String {
    text.split('&')
        .map(|piece| match piece.split_once('=') {
            Some((key, _)) if is_secret_param(&decode(key, true).unwrap_or_else(|_| key.to_string())) => {
                format!("{key}={REDACTED}")
            }
            _ => piece.to_string(),
        })
        .collect::<Vec<_>>()
        .join("&")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ErrorKind;

    const PG: UrlSpec = UrlSpec::new("postgres", &["postgres", "postgresql"]);
    const KAFKA: UrlSpec = UrlSpec::new("kafka", &["kafka", "kafka+ssl"]).multi_host();
    const SQLITE: UrlSpec = UrlSpec::new("sqlite", &["sqlite"]).path_only();

    fn assert_config_error(err: &Error, backend: &str, secrets: &[&str]) {
        assert_eq!(err.kind(), ErrorKind::Config, "{err}");
        assert!(err.is_permanent(), "{err}");
        assert_eq!(err.backend(), backend, "{err}");
        for text in [err.to_string(), format!("{err:?}")] {
            for secret in secrets {
                assert!(!text.contains(secret), "{secret:?} leaked in {text}");
            }
        }
    }

    #[test]
    fn decodes_user_password_host_port_path_and_parameters() {
        // The password is `p@ss:w%rd/?#` once decoded.
        let url = ConnectionUrl::parse(
            &PG,
            "postgres://app%20user:p%40ss%3Aw%25rd%2F%3F%23@db.example.com:6543/my%20db?sslmode=require&application_name=a+b%2Bc",
        )
        .unwrap();
        assert_eq!(url.scheme(), "postgres");
        assert_eq!(url.user(), Some("app user"));
        assert_eq!(url.password(), Some("p@ss:w%rd/?#"));
        assert_eq!(url.hosts(), [HostPort { host: "db.example.com".into(), port: Some(6543) }]);
        assert_eq!(url.path(), "/my db");
        assert_eq!(url.raw_path(), "/my%20db");
        assert_eq!(url.param("sslmode"), Some("require"));
        assert_eq!(url.param("application_name"), Some("a b+c"));
        assert_eq!(url.params().len(), 2);
        assert_eq!(
            url.redacted(),
            "postgres://app%20user:***@db.example.com:6543/my%20db?sslmode=require&application_name=a+b%2Bc"
        );
        url.finish().unwrap();
    }

    #[test]
    fn an_unencoded_at_in_the_password_still_splits_at_the_last_at() {
        let url = ConnectionUrl::parse(&PG, "postgres://u:p@ss@h/db").unwrap();
        assert_eq!((url.user(), url.password()), (Some("u"), Some("p@ss")));
        assert_eq!(url.require_host().unwrap().host(), "h");
        assert!(!url.to_string().contains("p@ss"));
    }

    #[test]
    fn no_user_info_no_port_no_path() {
        let url = ConnectionUrl::parse(&PG, "postgresql://h").unwrap();
        assert_eq!((url.user(), url.password()), (None, None));
        assert_eq!(url.host().unwrap().port(), None);
        assert_eq!(url.host().unwrap().port_or(5432), 5432);
        assert_eq!(url.path(), "");
        let url = ConnectionUrl::parse(&PG, "postgres://:only-pw@h:1/").unwrap();
        assert_eq!((url.user(), url.password()), (Some(""), Some("only-pw")));
        assert_eq!(url.path(), "/");
        let url = ConnectionUrl::parse(&PG, "postgres:///db").unwrap();
        assert!(url.hosts().is_empty());
        assert!(url.require_host().is_err());
        assert_eq!(url.path(), "/db");
    }

    #[test]
    fn multi_host_lists_and_ipv6() {
        let url = ConnectionUrl::parse(&KAFKA, "kafka://me:s%3Acret@h1:9092,h2:9093,[::1]:9094,%5Bx:1").unwrap_err();
        assert_config_error(&url, "kafka", &["s%3Acret", "s:cret"]);
        let err = ConnectionUrl::parse(&KAFKA, "kafka://h%3A1:9092").unwrap_err();
        assert!(err.to_string().contains("not a host name"), "{err}");
        let url = ConnectionUrl::parse(&KAFKA, "kafka://[fe80::1%25eth0]:9092").unwrap();
        assert_eq!(url.host().unwrap().host(), "fe80::1%eth0");
        let url = ConnectionUrl::parse(&KAFKA, "KAFKA+SSL://me:s%3Acret@h1:9092,h2:9093,[::1]:9094/").unwrap();
        assert_eq!(url.scheme(), "kafka+ssl");
        let hosts: Vec<String> = url.hosts().iter().map(ToString::to_string).collect();
        assert_eq!(hosts, ["h1:9092", "h2:9093", "[::1]:9094"]);
        assert_eq!(url.hosts()[2].host(), "::1");
        assert_eq!(url.password(), Some("s:cret"));
        assert_eq!(url.hosts()[0].with_port(1), "h1:9092");
        // One host only where the backend connects to one.
        let err = ConnectionUrl::parse(&PG, "postgres://u:pw-secret@h1:5432,h2:5432/db").unwrap_err();
        assert_config_error(&err, "postgres", &["pw-secret"]);
        assert!(err.to_string().contains("2 hosts"), "{err}");
        // Empty entries and bad ports.
        for bad in ["kafka://h1:9092,,h2:9092", "kafka://h1:90x2", "kafka://h1:70000", "kafka://:9092", "kafka://[::1"]
        {
            let err = ConnectionUrl::parse(&KAFKA, bad).unwrap_err();
            assert_config_error(&err, "kafka", &[]);
        }
    }

    #[test]
    fn path_only_urls() {
        for (raw, path) in [
            ("sqlite:///var/lib/a%20b.db", "/var/lib/a b.db"),
            ("sqlite:rel/x.db", "rel/x.db"),
            ("sqlite://rel/x.db", "rel/x.db"),
            ("SQLite:x.db?outbox_pool_size=2", "x.db"),
        ] {
            let url = ConnectionUrl::parse(&SQLITE, raw).unwrap();
            assert_eq!(url.path(), path, "{raw}");
            assert!(url.hosts().is_empty());
        }
        let url = ConnectionUrl::parse(&SQLITE, "sqlite:/x.db#frag").unwrap();
        assert_eq!(url.fragment(), Some("frag"));
        assert_eq!(encode_path("/var/lib/a b%#?.db"), "/var/lib/a%20b%25%23%3F.db");
        let back = ConnectionUrl::parse(&SQLITE, &format!("sqlite://{}", encode_path("/a b/é%#?.db"))).unwrap();
        assert_eq!(back.path(), "/a b/é%#?.db");
    }

    #[test]
    fn scheme_errors_name_the_backend_and_redact() {
        let err = ConnectionUrl::parse(&PG, "mysql://root:hunter2@h/db").unwrap_err();
        assert_config_error(&err, "postgres", &["hunter2"]);
        let text = err.to_string();
        assert!(text.starts_with("postgres: "), "{text}");
        assert!(text.contains("mysql://root:***@h/db"), "{text}");
        assert!(text.contains("postgres:// or postgresql://"), "{text}");
        for bad in ["not a url", "root:hunter2@h:5432/db", "", "postgres://u:hunter2@h/db\n", "//u:hunter2@h"] {
            let err = ConnectionUrl::parse(&PG, bad).unwrap_err();
            assert_config_error(&err, "postgres", &["hunter2"]);
        }
        let err = ConnectionUrl::parse(&SQLITE, "postgres://u:hunter2@h/db").unwrap_err();
        assert!(err.to_string().contains("expected sqlite:"), "{err}");
        let err = ConnectionUrl::parse(&PG, "postgres:h/db").unwrap_err();
        assert!(err.to_string().contains("expected postgres://"), "{err}");
    }

    #[test]
    fn bad_percent_escapes_are_errors_not_literals() {
        for bad in [
            "postgres://u:hunter2%@h/db",
            "postgres://u:hunter2%zz@h/db",
            "postgres://u:%FFhunter2@h/db",
            "postgres://u@h/d%zzb",
            "postgres://u@h%2/db",
            "postgres://u@h/db?k=%x1",
            "postgres://u@h/db?k%=1",
        ] {
            let err = ConnectionUrl::parse(&PG, bad).unwrap_err();
            assert_config_error(&err, "postgres", &["hunter2"]);
        }
        let err = ConnectionUrl::parse(&PG, "postgres://u@h/db?password=hunter2%").unwrap_err();
        assert_config_error(&err, "postgres", &["hunter2"]);
    }

    #[test]
    fn outbox_parameters_are_typed_checked_and_stripped() {
        let mut url = ConnectionUrl::parse(
            &PG,
            "postgres://u:pw@h/db?outbox_schema=ops&sslmode=disable&outbox_pool_size=3&outbox_timeout_ms=250\
             &outbox_big=18446744073709551615&outbox_flag=ON&outbox_mode=b&outbox_empty=&x=1&x=2#frag",
        )
        .unwrap();
        assert_eq!(url.outbox_str("outbox_schema").as_deref(), Some("ops"));
        assert_eq!(url.outbox_str("outbox_missing"), None);
        assert_eq!(url.outbox_u32("outbox_pool_size").unwrap(), Some(3));
        assert_eq!(url.outbox_duration_ms("outbox_timeout_ms").unwrap(), Some(Duration::from_millis(250)));
        assert_eq!(url.outbox_u64("outbox_big").unwrap(), Some(u64::MAX));
        assert_eq!(url.outbox_bool("outbox_flag").unwrap(), Some(true));
        assert_eq!(url.outbox_str("outbox_empty").as_deref(), Some(""));
        #[derive(Debug, PartialEq)]
        enum Mode {
            A,
            B,
        }
        impl FromStr for Mode {
            type Err = Error;
            fn from_str(s: &str) -> Result<Self> {
                match s {
                    "a" => Ok(Self::A),
                    "b" => Ok(Self::B),
                    _ => Err(Error::config("postgres", format!("expected `a` or `b`, not {s:?}"))),
                }
            }
        }
        assert_eq!(url.outbox_parse::<Mode>("outbox_mode").unwrap(), Some(Mode::B));
        assert_ne!(Mode::A, Mode::B);
        url.finish().unwrap();
        assert_eq!(url.driver_url(), "postgres://u:pw@h/db?sslmode=disable&x=1&x=2#frag");
        assert_eq!(url.params().len(), 3);
        assert_eq!(url.param("x"), Some("1"));

        let mut bad = ConnectionUrl::parse(&PG, "postgres://h/db?outbox_mode=c").unwrap();
        let err = bad.outbox_parse::<Mode>("outbox_mode").unwrap_err();
        assert_eq!(err.to_string(), "postgres: URL parameter outbox_mode=\"c\": expected `a` or `b`, not \"c\"");
        let mut bad = ConnectionUrl::parse(&PG, "postgres://h/db?outbox_n=1.5").unwrap();
        assert_eq!(bad.outbox_parse::<u8>("outbox_n").unwrap_err().kind(), ErrorKind::Config);

        // No outbox parameters: the query disappears from the driver URL.
        let url = ConnectionUrl::parse(&PG, "postgres://h/db?outbox_a=1&outbox_b=2").unwrap();
        assert_eq!(url.driver_url(), "postgres://h/db");
    }

    #[test]
    fn bad_numbers_and_booleans_name_parameter_and_value() {
        for (query, name, why) in [
            ("outbox_pool_size=abc", "outbox_pool_size", "whole number"),
            ("outbox_pool_size=-1", "outbox_pool_size", "whole number"),
            ("outbox_pool_size=", "outbox_pool_size", "got nothing"),
            ("outbox_pool_size=4294967296", "outbox_pool_size", "too large"),
            ("outbox_pool_size=1e3", "outbox_pool_size", "whole number"),
            ("outbox_lock_timeout_ms=2s", "outbox_lock_timeout_ms", "whole number"),
            ("outbox_flag=maybe", "outbox_flag", "`true` or `false`"),
        ] {
            let mut url = ConnectionUrl::parse(&PG, &format!("postgres://u:hunter2@h/db?{query}")).unwrap();
            let err = if name == "outbox_lock_timeout_ms" {
                url.outbox_duration_ms(name).unwrap_err()
            } else if name == "outbox_flag" {
                url.outbox_bool(name).unwrap_err()
            } else {
                url.outbox_u32(name).unwrap_err()
            };
            assert_config_error(&err, "postgres", &["hunter2"]);
            let text = err.to_string();
            let value = query.split_once('=').unwrap().1;
            assert!(text.contains(&format!("{name}={value:?}")), "{text}");
            assert!(text.contains(why), "{text}");
        }
    }

    #[test]
    fn unknown_outbox_parameters_fail_listing_the_known_ones() {
        let mut url =
            ConnectionUrl::parse(&PG, "postgres://u:hunter2@h/db?outbox_pool_size=2&outbox_pool_sise=3").unwrap();
        url.outbox_u32("outbox_pool_size").unwrap();
        url.outbox_str("outbox_schema");
        let err = url.finish().unwrap_err();
        assert_config_error(&err, "postgres", &["hunter2"]);
        let text = err.to_string();
        assert!(text.contains("\"outbox_pool_sise\""), "{text}");
        assert!(text.contains("known: outbox_pool_size, outbox_schema"), "{text}");
        assert_eq!(url.known_params(), ["outbox_pool_size", "outbox_schema"]);
        // The prefix in another case is still ours, and still unknown.
        let url = ConnectionUrl::parse(&PG, "postgres://h/db?OUTBOX_POOL_SIZE=2").unwrap();
        assert!(url.params().is_empty());
        assert!(url.finish().is_err());
        // Given twice.
        let err = ConnectionUrl::parse(&PG, "postgres://h/db?outbox_a=1&outbox_a=2").unwrap_err();
        assert!(err.to_string().contains("more than once"), "{err}");
        // A backend without driver parameters rejects every other one too.
        let mut url = ConnectionUrl::parse(&SQLITE, "sqlite:x.db?synchronous=full").unwrap();
        url.outbox_str("outbox_synchronous");
        let err = url.reject_driver_params().unwrap_err();
        assert!(err.to_string().contains("unknown URL parameter \"synchronous\" (known: outbox_synchronous)"), "{err}");
        // A backend with some: the first one it does not take, with its list.
        let url = ConnectionUrl::parse(&PG, "postgres://h/db?sslmode=disable&schema=ops&port=1").unwrap();
        let accepted = |name: &str| ["sslmode", "port"].contains(&name);
        let err = url.reject_driver_params_except(accepted, "or sslmode, port").unwrap_err();
        assert!(err.to_string().contains("unknown URL parameter \"schema\" (known: none; or sslmode, port)"), "{err}");
        let url = ConnectionUrl::parse(&PG, "postgres://h/db?sslmode=disable&port=1").unwrap();
        assert!(url.reject_driver_params_except(accepted, "").is_ok());
    }

    #[test]
    fn redaction_hides_passwords_everywhere() {
        for (raw, shown) in [
            ("redis://:hunter2@h:6379/0", "redis://:***@h:6379/0"),
            ("redis://alice@h", "redis://alice@h"),
            ("amqp://u:hunter2@h/%2f", "amqp://u:***@h/%2f"),
            ("postgres://u:p@ss:hunter2@h/db", "postgres://u:***@h/db"),
            ("postgres://h/db?password=hunter2&sslmode=require", "postgres://h/db?password=***&sslmode=require"),
            ("kafka://h:1?sasl.password=hunter2&linger.ms=5", "kafka://h:1?sasl.password=***&linger.ms=5"),
            (
                "kafka://h:1?ssl.key.password=hunter2&sasl.oauthbearer.client.secret=hunter2",
                "kafka://h:1?ssl.key.password=***&sasl.oauthbearer.client.secret=***",
            ),
            ("x://h?api_token=hunter2&Pass%77ord=hunter2", "x://h?api_token=***&Pass%77ord=***"),
            ("x://h#token=hunter2", "x://h#token=***"),
            ("redis://alice:hunter2@[bad", "redis://alice:***@[bad"),
            ("x://u:hunter2@h/path@with-at", "x://u:***@with-at"),
            ("sqlite:///var/db.sqlite?outbox_pool_size=2", "sqlite:///var/db.sqlite?outbox_pool_size=2"),
            ("not a url", HIDDEN_URL),
            ("user:hunter2@host:1", HIDDEN_URL),
            ("hunter2", HIDDEN_URL),
            ("", HIDDEN_URL),
        ] {
            assert_eq!(redact(raw), shown, "{raw}");
        }
        let url = ConnectionUrl::parse(&PG, "postgres://u:hunter2@h/db?password=hunter3").unwrap();
        for text in [url.to_string(), format!("{url:?}"), format!("{url:#?}"), url.error("x").to_string()] {
            assert!(!text.contains("hunter2") && !text.contains("hunter3"), "{text}");
            assert!(text.contains(REDACTED), "{text}");
        }
        assert!(url.driver_url().contains("hunter2"));
        let err = url.param_error("password", "hunter3", "no");
        assert!(!err.to_string().contains("hunter3"), "{err}");
    }

    #[test]
    fn secret_parameter_names() {
        for secret in ["password", "PASSWORD", "sasl.password", "ssl.key.password", "client_secret", "token", "api_key"]
        {
            assert!(is_secret_param(secret), "{secret}");
        }
        for plain in ["sslmode", "user", "linger.ms", "application_name", "outbox_pool_size"] {
            assert!(!is_secret_param(plain), "{plain}");
        }
    }

    #[test]
    fn env_url_has_no_fallback() {
        // Variable names of this test only; nothing else reads them.
        let missing = "OUTBOX_CORE_TEST_SURELY_UNSET_URL";
        let err = env_url(missing, "postgres").unwrap_err();
        assert_config_error(&err, "postgres", &[]);
        let text = err.to_string();
        assert!(
            text.contains(missing) && text.contains("postgres connection URL") && text.contains("no default"),
            "{text}"
        );
        assert_eq!(env_var(missing, "postgres").unwrap(), None);
        // PATH is set in any test environment (and is not a URL; env_url does not parse).
        assert!(env_url("PATH", "postgres").is_ok());
    }

    const NON_UNICODE_VAR: &str = "OUTBOX_CORE_TEST_NON_UNICODE_URL";

    /// A variable cannot be set safely in a multi-threaded test process, so this runs the test
    /// binary again with one set to bytes that are not UTF-8, and only the probe below.
    #[cfg(unix)]
    #[test]
    fn env_url_rejects_non_unicode_without_showing_it() {
        use std::os::unix::ffi::OsStringExt;
        let exe = std::env::current_exe().expect("test binary path");
        let out = std::process::Command::new(exe)
            .args(["--exact", "config::tests::non_unicode_probe", "--ignored", "--nocapture", "--test-threads=1"])
            .env(NON_UNICODE_VAR, std::ffi::OsString::from_vec(b"postgres://u:hunter2\xff@h/db".to_vec()))
            .output()
            .expect("run the probe");
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "probe failed: {stdout}{}", String::from_utf8_lossy(&out.stderr));
        assert!(stdout.contains("1 passed"), "the probe did not run: {stdout}");
    }

    #[test]
    #[ignore = "run by env_url_rejects_non_unicode_without_showing_it with the variable set"]
    fn non_unicode_probe() {
        let err = env_url(NON_UNICODE_VAR, "postgres").unwrap_err();
        assert_config_error(&err, "postgres", &["hunter2"]);
        assert!(err.to_string().contains(NON_UNICODE_VAR) && err.to_string().contains("not valid Unicode"), "{err}");
    }
}
