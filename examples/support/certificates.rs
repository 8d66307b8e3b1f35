//! Certificates for tests over TLS on loopback (the gRPC example's, the Redis store's):
//! made by `rcgen` on each run, never stored.

/// A CA, and a certificate for 127.0.0.1 and localhost that it signed: (CA PEM,
/// certificate PEM, key PEM).
#[allow(dead_code)] // the gRPC example uses this one only, the Redis tests the other
pub fn signed_for_loopback() -> (String, String, String) {
    let (ca, certificate, key, _) = signed_for_loopback_and_a_client();
    (ca, certificate, key)
}

/// As [`signed_for_loopback`], with a client certificate the CA signed too: (CA PEM,
/// server certificate PEM, server key PEM, (client certificate PEM, client key PEM)).
#[allow(dead_code)]
pub fn signed_for_loopback_and_a_client() -> (String, String, String, (String, String)) {
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
    let client = CertificateParams::new(vec!["tollgate-client".to_owned()]).unwrap();
    let client_key = KeyPair::generate().unwrap();
    let client_cert = client
        .signed_by(&client_key, &Issuer::from_params(&ca, &ca_key))
        .unwrap();
    (
        ca_cert.pem(),
        server_cert.pem(),
        server_key.serialize_pem(),
        (client_cert.pem(), client_key.serialize_pem()),
    )
}
