//! Who may use the console: off loopback a `--token` is required, and when one is set
//! every request must carry it; without one, only requests that name a loopback host are
//! answered (an `Authorization: Bearer` header, or the cookie the
//! console sets when a link with `?token=` is opened); every action is a POST whose
//! form carries the process's CSRF token, so that another site cannot make an
//! operator's browser act.

use std::net::SocketAddr;

use axum::extract::{Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::{PageError, Shared};

/// The cookie that carries the token once a browser has given it.
const TOKEN_COOKIE: &str = "sagabox_console_token";

/// The console refuses to listen there as configured.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum ListenError {
    /// Off loopback without a token, anyone who reaches the port could act.
    #[error(
        "{0} is not a loopback address: give --token SECRET (every request must then carry it), or listen on 127.0.0.1"
    )]
    TokenRequired(SocketAddr),
    /// A token too short to be a secret.
    #[error("--token is {0} characters long: give at least 16")]
    TokenTooShort(usize),
}

/// Checks where the console listens against the token it has.
pub(crate) fn check_listen(addr: SocketAddr, token: Option<&str>) -> Result<(), ListenError> {
    match token {
        Some(token) if token.chars().count() < 16 => {
            Err(ListenError::TokenTooShort(token.chars().count()))
        }
        Some(_) => Ok(()),
        None if addr.ip().is_loopback() => Ok(()),
        None => Err(ListenError::TokenRequired(addr)),
    }
}

/// A fresh random secret, 32 hex digits.
pub(crate) fn new_secret() -> String {
    uuid::Uuid::new_v4().simple().to_string()
}

/// Whether `given` equals `expected`, in a time that does not depend on where they
/// differ (so the token cannot be guessed a character at a time).
pub(crate) fn same_secret(given: &str, expected: &str) -> bool {
    let (given, expected) = (given.as_bytes(), expected.as_bytes());
    given.len() == expected.len()
        && given
            .iter()
            .zip(expected)
            .fold(0u8, |diff, (a, b)| diff | (a ^ b))
            == 0
}

/// The middleware: with a token configured, a request without it gets 401.
pub(crate) async fn check_token(
    State(console): State<Shared>,
    request: Request,
    next: Next,
) -> Response {
    let Some(expected) = console.config.token.as_deref() else {
        // Without a token the console listens on loopback only; a page of another site
        // whose name was made to resolve to 127.0.0.1 (DNS rebinding) still names its
        // own host, and is refused here before it can read a page or its CSRF token.
        if !loopback_host(request.headers()) {
            return PageError::new(
                StatusCode::FORBIDDEN,
                "this console answers only to localhost, 127.0.0.1 or [::1]: give it a --token to be reached by another name",
            )
            .into_response();
        }
        return next.run(request).await;
    };
    let from_query = request
        .uri()
        .query()
        .and_then(|query| query_value(query, "token"))
        .filter(|given| same_secret(given, expected));
    let carried = bearer(request.headers()).is_some_and(|given| same_secret(given, expected))
        || cookie(request.headers(), TOKEN_COOKIE)
            .is_some_and(|given| same_secret(given, expected));
    if carried {
        return next.run(request).await;
    }
    if from_query.is_some() {
        // Remembered by the browser so that the console's own links need not repeat it.
        let mut response = next.run(request).await;
        let cookie = format!("{TOKEN_COOKIE}={expected}; Path=/; HttpOnly; SameSite=Strict");
        if let Ok(value) = cookie.parse() {
            response.headers_mut().insert(header::SET_COOKIE, value);
        }
        return response;
    }
    PageError::new(
        StatusCode::UNAUTHORIZED,
        "this console needs its token: open it with ?token=SECRET or send Authorization: Bearer SECRET",
    )
    .into_response()
}

/// Refuses an action unless actions are on and `csrf` is this process's token.
pub(crate) fn check_action(console: &Shared, csrf: &str) -> Result<(), PageError> {
    if !console.config.allow_actions {
        return Err(PageError::new(
            StatusCode::FORBIDDEN,
            "actions are off: start the console with --allow-actions to retry, cancel or replay",
        ));
    }
    if !same_secret(csrf, &console.csrf) {
        return Err(PageError::new(
            StatusCode::FORBIDDEN,
            "the form's CSRF token is missing or stale: reload the page and try again",
        ));
    }
    Ok(())
}

/// Whether the request's `Host` names a loopback address (a request without one, from
/// HTTP/1.0, cannot come from a browser page and passes).
fn loopback_host(headers: &HeaderMap) -> bool {
    let Some(host) = headers.get(header::HOST) else {
        return true;
    };
    let Ok(host) = host.to_str() else {
        return false;
    };
    // Without the port: `[::1]:8080`, `127.0.0.1:8080`, `localhost`.
    let name = match host.strip_prefix('[') {
        Some(rest) => rest.split(']').next().unwrap_or(""),
        None => host.rsplit_once(':').map_or(host, |(name, _)| name),
    };
    name.eq_ignore_ascii_case("localhost")
        || name
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

fn bearer(headers: &HeaderMap) -> Option<&str> {
    headers
        .get(header::AUTHORIZATION)?
        .to_str()
        .ok()?
        .strip_prefix("Bearer ")
}

fn cookie<'h>(headers: &'h HeaderMap, name: &str) -> Option<&'h str> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|value| value.to_str().ok())
        .flat_map(|value| value.split(';'))
        .find_map(|pair| pair.trim().strip_prefix(name)?.strip_prefix('='))
}

fn query_value<'q>(query: &'q str, name: &str) -> Option<&'q str> {
    query
        .split('&')
        .find_map(|pair| pair.strip_prefix(name)?.strip_prefix('='))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn off_loopback_a_long_enough_token_is_required() {
        let public: SocketAddr = "0.0.0.0:8080".parse().unwrap_or_else(|_| unreachable!());
        let local: SocketAddr = "127.0.0.1:8080".parse().unwrap_or_else(|_| unreachable!());
        assert_eq!(check_listen(local, None), Ok(()));
        assert_eq!(
            check_listen(public, None),
            Err(ListenError::TokenRequired(public))
        );
        assert_eq!(
            check_listen(public, Some("short")),
            Err(ListenError::TokenTooShort(5))
        );
        assert_eq!(check_listen(public, Some("0123456789abcdef")), Ok(()));
    }

    #[test]
    fn only_loopback_names_pass_without_a_token() {
        let with = |host: &str| {
            let mut headers = HeaderMap::new();
            headers.insert(
                header::HOST,
                host.parse().unwrap_or_else(|_| unreachable!()),
            );
            loopback_host(&headers)
        };
        for host in [
            "127.0.0.1:8080",
            "localhost",
            "LOCALHOST:1",
            "[::1]:8080",
            "127.1.2.3",
        ] {
            assert!(with(host), "{host}");
        }
        for host in [
            "evil.example",
            "evil.example:8080",
            "10.0.0.1:8080",
            "[::2]:80",
            "localhost.evil",
        ] {
            assert!(!with(host), "{host}");
        }
    }

    #[test]
    fn secrets_compare_whole() {
        assert!(same_secret("abc", "abc"));
        assert!(!same_secret("abd", "abc"));
        assert!(!same_secret("ab", "abc"));
        assert!(!same_secret("", "abc"));
    }
}
