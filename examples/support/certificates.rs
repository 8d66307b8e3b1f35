//! Certificates for tests over TLS on loopback (the gRPC example's, the Redis store's):
//! made by `rcgen` on each run, never stored.

/// A CA, and a certificate for 127.0.0.1 and localhost that it signed: (CA PEM,
/// certificate PEM, key PEM).
pub fn signed_for_loopback() -> (String, String, String) {
    use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair};
    let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.distinguished_name
        .push(DnType::CommonName, "tollgate test CA");
    let ca_key = KeyPair::generate().unwrap();
    let ca_cert = ca.self_signed(&ca_key).unwrap();
    let server =
        CertificateParams::new(vec!["127.0.0.1".to_owned(), "localhost".to_owned()]).unwrap();
    let server_key = KeyPair::generate().unwrap();
    let server_cert = server
        .signed_by(&server_key, &Issuer::from_params(&ca, &ca_key))
        .unwrap();
    (ca_cert.pem(), server_cert.pem(), server_key.serialize_pem())
}
