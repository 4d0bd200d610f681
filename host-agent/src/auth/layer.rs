//! The tower layer in front of every gRPC service: resolves the caller once,
//! checks the method's scope ([`super::methods::required`]), and hands the
//! [`Caller`] to the service in the request's extensions.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use tonic::codegen::http;
use tonic::transport::server::{TcpConnectInfo, TlsConnectInfo, UdsConnectInfo};
use tonic::Status;

use super::cert::subject_cn;
use super::clients::Clients;
use super::methods::{required, Access};
use super::{Caller, Scope, LOCAL_CLIENT};

/// How callers are identified on this node.
#[derive(Debug, Clone, Default)]
pub struct Authenticator {
    /// Token and certificate clients (empty without a clients file).
    pub clients: Clients,
    /// The scope of a local caller without credentials (Unix socket, or a
    /// loopback TCP peer without TLS); `None` refuses such calls.
    pub unauthenticated_local: Option<Scope>,
}

impl Authenticator {
    /// The caller of a request with these headers and extensions, or
    /// UNAUTHENTICATED. A presented credential must be valid: a wrong token
    /// is never treated as no token.
    pub fn identify(
        &self,
        headers: &http::HeaderMap,
        ext: &http::Extensions,
    ) -> Result<Caller, Status> {
        if let Some(v) = headers.get(http::header::AUTHORIZATION) {
            // The token is never logged or echoed.
            let token = v
                .to_str()
                .ok()
                .and_then(|s| s.strip_prefix("Bearer "))
                .map(str::trim)
                .filter(|t| !t.is_empty())
                .ok_or_else(|| {
                    Status::unauthenticated("the authorization header must be `Bearer <token>`")
                })?;
            return self.clients.by_token(token).cloned().ok_or_else(|| {
                Status::unauthenticated(
                    "the bearer token is not in host-agent's clients file (clients_file)",
                )
            });
        }
        let certs = ext
            .get::<TlsConnectInfo<TcpConnectInfo>>()
            .and_then(|i| i.peer_certs())
            .or_else(|| {
                ext.get::<TlsConnectInfo<UdsConnectInfo>>()
                    .and_then(|i| i.peer_certs())
            });
        if let Some(certs) = certs {
            let Some(leaf) = certs.first() else {
                return Err(Status::unauthenticated("no client certificate"));
            };
            let cn = subject_cn(leaf).ok_or_else(|| {
                Status::unauthenticated(
                    "the client certificate's subject has no single common name (CN)",
                )
            })?;
            return self.clients.by_cert(&cn).cloned().ok_or_else(|| {
                Status::unauthenticated(format!(
                    "client certificate CN={cn:?} is not listed with `mtls` in host-agent's \
                     clients file (clients_file)"
                ))
            });
        }
        let local = ext.get::<UdsConnectInfo>().is_some()
            || ext
                .get::<TcpConnectInfo>()
                .and_then(|i| i.remote_addr())
                .is_some_and(|a| a.ip().is_loopback());
        match self.unauthenticated_local {
            Some(scope) if local => Ok(Caller {
                name: LOCAL_CLIENT.to_string(),
                scope,
            }),
            _ => Err(Status::unauthenticated(
                "no credentials: send `authorization: Bearer <token>` (a token listed in \
                 clients_file) or a client certificate; local calls without credentials are \
                 allowed only with unauthenticated_local (--allow-unauthenticated-local)",
            )),
        }
    }

    /// The caller of `req` if it may call the method it names.
    pub fn authorize<B>(&self, req: &http::Request<B>) -> Result<Option<Caller>, Status> {
        let path = req.uri().path();
        let need = match required(path) {
            Access::Open => return Ok(None),
            Access::Unknown => {
                return Err(Status::unimplemented(format!(
                    "{path} is not a host-agent method"
                )))
            }
            Access::Needs(s) => s,
        };
        let caller = self.identify(req.headers(), req.extensions())?;
        if !caller.may(need) {
            return Err(Status::permission_denied(format!(
                "client {:?} has scope {} but {path} needs {need}",
                caller.name, caller.scope
            )));
        }
        Ok(Some(caller))
    }
}

/// Layer that puts [`AuthService`] in front of the routes.
#[derive(Clone)]
pub struct AuthLayer(pub Arc<Authenticator>);

impl<S> tower::Layer<S> for AuthLayer {
    type Service = AuthService<S>;

    fn layer(&self, inner: S) -> AuthService<S> {
        AuthService {
            inner,
            auth: self.0.clone(),
        }
    }
}

/// Refuses calls the caller may not make; passes the rest on with the
/// [`Caller`] in their extensions.
#[derive(Clone)]
pub struct AuthService<S> {
    inner: S,
    auth: Arc<Authenticator>,
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

impl<S, B> tower::Service<http::Request<B>> for AuthService<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<tonic::body::Body>>,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = BoxFuture<Result<Self::Response, Self::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: http::Request<B>) -> Self::Future {
        match self.auth.authorize(&req) {
            Ok(caller) => {
                if let Some(c) = caller {
                    req.extensions_mut().insert(c);
                }
                Box::pin(self.inner.call(req))
            }
            Err(status) => {
                crate::metrics::api_error(status.code());
                Box::pin(std::future::ready(Ok(status.into_http())))
            }
        }
    }
}

/// The caller the layer resolved for `req`; an internal error if the layer
/// did not run (a service served without it).
pub fn caller_of<T>(req: &tonic::Request<T>) -> Result<Caller, Status> {
    req.extensions()
        .get::<Caller>()
        .cloned()
        .ok_or_else(|| Status::internal("no caller identity: the auth layer did not run"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use sha2::{Digest, Sha256};

    fn auth(local: Option<Scope>) -> Authenticator {
        let text = format!(
            "reader read sha256:{}\n",
            hex::encode(Sha256::digest(b"secret-r"))
        );
        Authenticator {
            clients: Clients::parse(&text).unwrap(),
            unauthenticated_local: local,
        }
    }

    fn req(path: &str, token: Option<&str>, local: bool) -> http::Request<()> {
        let mut r = http::Request::builder().uri(path);
        if let Some(t) = token {
            r = r.header("authorization", format!("Bearer {t}"));
        }
        let mut r = r.body(()).unwrap();
        let peer: std::net::SocketAddr = if local {
            "127.0.0.1:5000".parse().unwrap()
        } else {
            "10.0.0.9:5000".parse().unwrap()
        };
        r.extensions_mut().insert(TcpConnectInfo {
            local_addr: None,
            remote_addr: Some(peer),
        });
        r
    }

    #[test]
    fn scopes_and_credentials_decide() {
        use tonic::Code;
        let a = auth(None);
        let code = |r: Result<Option<Caller>, Status>| r.map(|_| ()).map_err(|s| s.code());
        let get = "/hostagent.v1.Sessions/GetSession";
        let create = "/hostagent.v1.Sessions/CreateSession";
        assert_eq!(
            code(a.authorize(&req(get, Some("secret-r"), false))),
            Ok(())
        );
        assert_eq!(
            code(a.authorize(&req(create, Some("secret-r"), false))),
            Err(Code::PermissionDenied)
        );
        assert_eq!(
            code(a.authorize(&req(get, Some("wrong"), true))),
            Err(Code::Unauthenticated)
        );
        assert_eq!(
            code(a.authorize(&req(get, None, true))),
            Err(Code::Unauthenticated)
        );
        assert_eq!(
            code(a.authorize(&req("/grpc.health.v1.Health/Check", None, false))),
            Ok(())
        );
        assert_eq!(
            code(a.authorize(&req("/x.Y/Z", Some("secret-r"), false))),
            Err(Code::Unimplemented)
        );
        let local = auth(Some(Scope::Admin));
        let c = local.authorize(&req(create, None, true)).unwrap().unwrap();
        assert_eq!((c.name.as_str(), c.scope), (LOCAL_CLIENT, Scope::Admin));
        assert_eq!(
            code(local.authorize(&req(create, None, false))),
            Err(Code::Unauthenticated),
            "a remote peer is never local"
        );
        // A wrong token is refused even where local calls are allowed.
        assert_eq!(
            code(local.authorize(&req(get, Some("wrong"), true))),
            Err(Code::Unauthenticated)
        );
    }

    #[test]
    fn messages_never_hold_the_token() {
        let a = auth(None);
        let err = a
            .authorize(&req(
                "/hostagent.v1.Node/GetVersion",
                Some("s3cr3t-value"),
                false,
            ))
            .unwrap_err();
        assert!(!err.message().contains("s3cr3t"), "{}", err.message());
    }
}
