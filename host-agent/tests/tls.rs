//! Who may call: plain text is accepted on loopback only; with mutual TLS
//! every client must present a certificate signed by the configured CA, and
//! its subject CN must be listed with `mtls` in the clients file.
//! Certificates are made with the `openssl` command-line tool.

mod common;

use std::path::Path;
use std::process::Command;

use common::*;
use proto::hostagent as pb;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Identity};

fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl")
        .current_dir(dir)
        .args(args)
        .output()
        .expect("openssl runs");
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A CA named `name` and a certificate it signs for `cn` with `ext`.
fn make_ca(dir: &Path, name: &str) {
    openssl(
        dir,
        &[
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            &format!("{name}.key"),
            "-out",
            &format!("{name}.pem"),
            "-days",
            "2",
            "-subj",
            &format!("/CN={name}"),
            "-addext",
            "basicConstraints=critical,CA:TRUE",
            "-addext",
            "keyUsage=critical,keyCertSign,cRLSign",
        ],
    );
}

fn make_cert(dir: &Path, ca: &str, name: &str, ext: &str) {
    std::fs::write(dir.join(format!("{name}.ext")), ext).unwrap();
    openssl(
        dir,
        &[
            "req",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            &format!("{name}.key"),
            "-out",
            &format!("{name}.csr"),
            "-subj",
            &format!("/CN={name}"),
        ],
    );
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            &format!("{name}.csr"),
            "-CA",
            &format!("{ca}.pem"),
            "-CAkey",
            &format!("{ca}.key"),
            "-CAcreateserial",
            "-out",
            &format!("{name}.pem"),
            "-days",
            "2",
            "-extfile",
            &format!("{name}.ext"),
        ],
    );
}

fn read(dir: &Path, f: &str) -> Vec<u8> {
    std::fs::read(dir.join(f)).unwrap()
}

async fn version(addr: &str, tls: Option<ClientTlsConfig>) -> Result<pb::Version, String> {
    let mut ep = Channel::from_shared(addr.to_string()).unwrap();
    if let Some(t) = tls {
        ep = ep.tls_config(t).map_err(|e| e.to_string())?;
    }
    let ch = ep.connect().await.map_err(|e| format!("connect: {e:?}"))?;
    pb::node_client::NodeClient::new(ch)
        .get_version(pb::GetVersionRequest {})
        .await
        .map(|r| r.into_inner())
        .map_err(|e| format!("call: {e:?}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutual_tls_refuses_clients_without_a_valid_certificate() {
    let certs = tempfile::tempdir().unwrap();
    let d = certs.path();
    make_ca(d, "ca");
    make_ca(d, "other-ca");
    make_cert(
        d,
        "ca",
        "server",
        "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n",
    );
    make_cert(d, "ca", "client", "extendedKeyUsage=clientAuth\n");
    make_cert(d, "ca", "viewer", "extendedKeyUsage=clientAuth\n");
    make_cert(d, "ca", "unlisted", "extendedKeyUsage=clientAuth\n");
    make_cert(d, "other-ca", "stranger", "extendedKeyUsage=clientAuth\n");
    std::fs::write(d.join("clients"), "client admin mtls\nviewer read mtls\n").unwrap();

    let p = |f: &str| d.join(f).display().to_string();
    let agent = Agent::start(&[
        "--tls-ca",
        &p("ca.pem"),
        "--tls-cert",
        &p("server.pem"),
        "--tls-key",
        &p("server.key"),
        "--clients-file",
        &p("clients"),
    ]);
    let https = agent.addr.replace("http://", "https://");
    let base = || {
        ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(read(d, "ca.pem")))
            .domain_name("localhost")
    };

    let ok = version(
        &https,
        Some(base().identity(Identity::from_pem(
            read(d, "client.pem"),
            read(d, "client.key"),
        ))),
    )
    .await;
    assert!(
        ok.is_ok(),
        "a client with a valid certificate is served: {ok:?}"
    );

    // A certificate of the CA whose CN is not in the clients file is not a client.
    let unlisted = version(
        &https,
        Some(base().identity(Identity::from_pem(
            read(d, "unlisted.pem"),
            read(d, "unlisted.key"),
        ))),
    )
    .await;
    assert!(
        unlisted
            .as_ref()
            .is_err_and(|e| e.contains("Unauthenticated") && e.contains("unlisted")),
        "an unlisted certificate is unauthenticated: {unlisted:?}"
    );
    // The certificate's client gets its scopes: read may look, not register.
    let viewer = base().identity(Identity::from_pem(
        read(d, "viewer.pem"),
        read(d, "viewer.key"),
    ));
    assert!(version(&https, Some(viewer.clone())).await.is_ok());
    let ch = Channel::from_shared(https.clone())
        .unwrap()
        .tls_config(viewer)
        .unwrap()
        .connect()
        .await
        .unwrap();
    let err = pb::images_client::ImagesClient::new(ch)
        .register_image(pb::RegisterImageRequest {
            image_id: "x".into(),
            kernel_path: "/x".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::PermissionDenied, "{err:?}");

    let no_cert = version(&https, Some(base())).await;
    assert!(
        no_cert.is_err(),
        "a client without a certificate is refused"
    );

    let stranger = version(
        &https,
        Some(base().identity(Identity::from_pem(
            read(d, "stranger.pem"),
            read(d, "stranger.key"),
        ))),
    )
    .await;
    assert!(
        stranger.is_err(),
        "a certificate from another CA is refused"
    );

    let plain = version(&agent.addr, None).await;
    assert!(plain.is_err(), "plain text is refused when TLS is on");
}

#[test]
fn non_loopback_without_tls_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_host-agent"))
        .args(["serve", "--listen", "0.0.0.0:0", "--state-dir"])
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("mutual TLS"), "{err}");
    assert!(out.stdout.is_empty(), "it never listened");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plain_text_on_loopback_is_unauthenticated_unless_allowed() {
    let agent = Agent::start(&["--no-test-defaults"]);
    let err = version(&agent.addr, None).await.unwrap_err();
    assert!(err.contains("Unauthenticated"), "{err}");
    let agent = Agent::start(&["--allow-unauthenticated-local"]);
    assert!(version(&agent.addr, None).await.is_ok());
}

#[test]
fn unauthenticated_local_with_mutual_tls_is_refused_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("x.pem");
    std::fs::write(&f, "").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_host-agent"))
        .args(["serve", "--allow-unauthenticated-local", "--state-dir"])
        .arg(dir.path())
        .args(["--tls-ca", f.to_str().unwrap()])
        .args(["--tls-cert", f.to_str().unwrap()])
        .args(["--tls-key", f.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("unauthenticated_local"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unix_socket_listener_and_cli_client() {
    use std::io::{BufRead, BufReader};
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("api.sock");
    let mut child = Command::new(env!("CARGO_BIN_EXE_host-agent"))
        .args(["serve", "--allow-unauthenticated-local", "--listen-unix"])
        .arg(&sock)
        .arg("--state-dir")
        .arg(dir.path().join("state"))
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert_eq!(
        line.trim(),
        format!("host-agent listening on unix:{}", sock.display())
    );
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(
        std::fs::metadata(&sock).unwrap().permissions().mode() & 0o777,
        0o600
    );

    let addr = format!("unix:{}", sock.display());
    let ch = host_agent::connect(&addr, None).await.unwrap();
    let v = pb::node_client::NodeClient::new(ch)
        .get_version(pb::GetVersionRequest {})
        .await
        .unwrap()
        .into_inner();
    assert!(!v.version.is_empty());

    // The operator CLI over the same socket.
    let out = Command::new(env!("CARGO_BIN_EXE_host-agent"))
        .args(["--addr", &addr, "images", "list"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = Command::new(env!("CARGO_BIN_EXE_host-agent"))
        .args(["--addr", &addr, "sessions", "get", "nope"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("NotFound"));
    let _ = child.kill();
    let _ = child.wait();
}
