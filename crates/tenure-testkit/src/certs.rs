//! A throw-away certificate authority: what the local cluster, the simulations, the tests and
//! `tenure certs` use to run TLS without an operator's PKI. Each certificate names one
//! principal ([`crate::tls::Principal`]) and the hosts it serves.
//!
//! A production cluster should use its own CA; this one keeps its key in memory (or in the
//! files `tenure certs` writes) and issues whatever it is asked to.

use crate::ids::NodeId;
use crate::tls::{NodeTls, Principal};
use crate::worker::ClientTls;
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose, SanType,
};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Why a certificate could not be made.
#[derive(Debug, thiserror::Error)]
#[error("certificate generation failed: {0}")]
pub struct CertError(String);

fn err(e: impl std::fmt::Display) -> CertError {
    CertError(e.to_string())
}

/// A certificate (PEM and DER) and its private key (PEM).
#[derive(Clone)]
pub struct Issued {
    pub cert_pem: String,
    pub cert_der: Vec<u8>,
    pub key_pem: String,
}

/// How long the certificates it issues are valid: from an hour ago (clocks differ) until
/// `valid_for` from now.
#[derive(Clone, Copy, Debug)]
pub struct Validity {
    pub valid_for: Duration,
    /// Issue a certificate that expired this long ago instead (to test refusal).
    pub expired: bool,
}

impl Default for Validity {
    fn default() -> Self {
        Validity { valid_for: Duration::from_secs(365 * 24 * 3600), expired: false }
    }
}

/// A certificate authority whose key lives in this process.
pub struct DevCa {
    ca_pem: String,
    issuer: Issuer<'static, KeyPair>,
}

impl DevCa {
    /// A new CA named `name`.
    pub fn new(name: &str) -> Result<DevCa, CertError> {
        let mut params = CertificateParams::default();
        params.distinguished_name.push(DnType::CommonName, name);
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let key = KeyPair::generate().map_err(err)?;
        let ca_pem = params.self_signed(&key).map_err(err)?.pem();
        Ok(DevCa { ca_pem, issuer: Issuer::new(params, key) })
    }

    /// A CA read back from its certificate and private key (PEM), to issue more certificates.
    pub fn from_pem(ca_pem: &str, key_pem: &str) -> Result<DevCa, CertError> {
        let key = KeyPair::from_pem(key_pem).map_err(err)?;
        let issuer = Issuer::from_ca_cert_pem(ca_pem, key).map_err(err)?;
        Ok(DevCa { ca_pem: ca_pem.to_string(), issuer })
    }

    /// The CA certificate every party trusts.
    pub fn ca_pem(&self) -> String {
        self.ca_pem.clone()
    }

    /// The CA's private key: whoever holds it can mint any principal. Keep it off the nodes.
    pub fn key_pem(&self) -> String {
        self.issuer.key().serialize_pem()
    }

    /// A certificate for `principal`, valid as a server for `hosts` (DNS names or IP addresses)
    /// and as a client everywhere.
    pub fn issue(
        &self,
        principal: &Principal,
        hosts: &[String],
        validity: Validity,
    ) -> Result<Issued, CertError> {
        let mut params = CertificateParams::new(hosts.to_vec()).map_err(err)?;
        params.distinguished_name.push(DnType::CommonName, principal.uri());
        let uri = principal.uri().try_into().map_err(err)?;
        params.subject_alt_names.push(SanType::URI(uri));
        params.extended_key_usages =
            vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth];
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        let now = time::OffsetDateTime::now_utc();
        if validity.expired {
            params.not_before = now - time::Duration::days(30);
            params.not_after = now - time::Duration::days(1);
        } else {
            params.not_before = now - time::Duration::hours(1);
            params.not_after = now + validity.valid_for;
        }
        let key = KeyPair::generate().map_err(err)?;
        let cert = params.signed_by(&key, &self.issuer).map_err(err)?;
        Ok(Issued { cert_pem: cert.pem(), cert_der: cert.der().to_vec(), key_pem: key.serialize_pem() })
    }

    /// Node `id`'s TLS material, serving `hosts`.
    pub fn node_tls(&self, id: NodeId, hosts: &[String]) -> Result<NodeTls, CertError> {
        let issued = self.issue(&Principal::Node(id), hosts, Validity::default())?;
        Ok(NodeTls {
            ca_pem: self.ca_pem().into_bytes(),
            cert_pem: issued.cert_pem.into_bytes(),
            key_pem: issued.key_pem.into_bytes(),
        })
    }

    /// A worker's or an operator's TLS material (a client certificate only: no hosts).
    pub fn client_tls(&self, principal: &Principal) -> Result<ClientTls, CertError> {
        let issued = self.issue(principal, &[], Validity::default())?;
        Ok(ClientTls {
            ca_pem: self.ca_pem().into_bytes(),
            cert_pem: issued.cert_pem.into_bytes(),
            key_pem: issued.key_pem.into_bytes(),
        })
    }

    /// Writes a certificate and key for `principal` into `dir`, as `<stem>.pem` and
    /// `<stem>-key.pem` (the names `tenure certs` uses), next to `ca.pem`; returns the three
    /// paths (CA, certificate, key).
    pub fn write_client_files(
        &self,
        dir: &Path,
        stem: &str,
        principal: &Principal,
    ) -> Result<[PathBuf; 3], CertError> {
        let issued = self.issue(principal, &[], Validity::default())?;
        let paths =
            [dir.join("ca.pem"), dir.join(format!("{stem}.pem")), dir.join(format!("{stem}-key.pem"))];
        // Each file appears whole or not at all: a process started for an earlier worker may be
        // reading `ca.pem` while this call writes it for the next (a plain write truncates it
        // first, and a reader then finds no certificate in it).
        write_whole(&paths[0], self.ca_pem().as_bytes()).map_err(err)?;
        write_whole(&paths[1], issued.cert_pem.as_bytes()).map_err(err)?;
        write_whole(&paths[2], issued.key_pem.as_bytes()).map_err(err)?;
        Ok(paths)
    }
}

/// Writes `bytes` to a file beside `path`, then renames it over `path`: readers see the old
/// file or the new one, never a truncated one.
fn write_whole(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let mut partial = path.as_os_str().to_owned();
    partial.push(format!(".partial-{}", std::process::id()));
    std::fs::write(&partial, bytes)?;
    std::fs::rename(&partial, path)
}
