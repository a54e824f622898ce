"""Tailnet: one Headscale control server and the operator's credentials for it."""

from __future__ import annotations

from typing import Literal, Self

from pydantic import ConfigDict, Field, model_validator

from tailnet_operator.api.common import (
    CIDR,
    GO_DURATION_PATTERN,
    ApiModel,
    BoundedString,
    Conditions,
    DNSName,
    Generation,
    HttpURL,
    NamespacedName,
    ObjectMeta,
    SecretKey,
    SecretKeyRef,
    Timestamp,
    cel,
    cel_string,
    parse_go_duration,
    validations,
)

MIN_API_KEY_LIFETIME_SECONDS = 3600.0


class BootstrapKeySecretRef(SecretKeyRef):
    """The Secret key holding the read-only bootstrap Headscale API key."""

    key: SecretKey = Field(default="apiKey", description="Key within the Secret's data. Defaults to apiKey.")


class CASecretRef(SecretKeyRef):
    """A Secret key holding PEM CA certificates."""

    key: SecretKey = Field(default="ca.crt", description="Key within the Secret's data. Defaults to ca.crt.")


class TailnetDNS(ApiModel):
    """The DNS hosts file this Tailnet owns."""

    hosts_config_map: NamespacedName = Field(
        description=(
            "The CoreDNS hosts ConfigMap the operator owns and rewrites with every egress alias "
            "and ingress name of this Tailnet."
        )
    )
    zones: list[DNSName] = Field(
        min_length=1,
        max_length=16,
        description="DNS zones served from the hosts file, e.g. tailnet.example.internal.",
        json_schema_extra={"x-kubernetes-list-type": "set"},
    )


class PolicyConfigMapRef(NamespacedName):
    """A key in a ConfigMap holding the base HuJSON policy."""

    key: SecretKey = Field(
        default="policy.hujson", description="Key within the ConfigMap's data. Defaults to policy.hujson."
    )


class TailnetPolicy(ApiModel):
    """Hands the Headscale policy to the operator."""

    base_config_map_ref: PolicyConfigMapRef = Field(
        description=(
            "The base policy (HuJSON). The operator appends tagOwners, /32 approvals and grants "
            "derived from the CRs; entries in the base always win and nothing is removed."
        )
    )
    mode: Literal["Render", "Apply"] = Field(
        default="Render",
        description=(
            "Render publishes the rendered policy in a ConfigMap only; Apply also writes it to "
            "Headscale when the live policy differs. Defaults to Render."
        ),
    )


class TailnetSpec(ApiModel):
    """Desired state of a Tailnet."""

    model_config = ConfigDict(
        json_schema_extra=validations(
            cel(
                "!(has(self.caBundle) && has(self.caSecretRef))",
                "set at most one of caBundle and caSecretRef",
                ".caSecretRef",
            )
        )
    )

    login_url: HttpURL = Field(
        alias="loginURL",
        description="URL of the Headscale server that agents use as their control server (--login-server).",
    )
    api_url: HttpURL | None = Field(
        default=None,
        alias="apiURL",
        description=(
            "URL the operator uses for the Headscale API, e.g. an in-cluster Service. Defaults to loginURL."
        ),
    )
    ca_bundle: str | None = Field(
        default=None,
        max_length=65536,
        description="PEM CA certificates to trust for loginURL and apiURL, for a private CA.",
        json_schema_extra=validations(
            cel("self.contains('-----BEGIN CERTIFICATE-----')", "must contain at least one PEM certificate")
        ),
    )
    ca_secret_ref: CASecretRef | None = Field(
        default=None, description="A Secret key with PEM CA certificates; an alternative to caBundle."
    )
    bootstrap_key_secret_ref: BootstrapKeySecretRef = Field(
        description=(
            "The Secret key with a Headscale API key the operator uses only to mint and rotate its own "
            "working key. The operator never writes this Secret."
        )
    )
    api_key_lifetime: str = Field(
        default="720h",
        max_length=32,
        pattern=GO_DURATION_PATTERN,
        description=(
            "Lifetime of the working API key as a Go duration (at least 1h); the key is rotated at "
            "half of it. Defaults to 720h."
        ),
        json_schema_extra=validations(
            cel(
                f"!self.matches({cel_string(GO_DURATION_PATTERN)}) || duration(self) >= duration('1h')",
                "must be at least 1h",
            )
        ),
    )
    reserved_networks: list[CIDR] | None = Field(
        default=None,
        max_length=32,
        description=(
            "Networks no TailnetSite may overlap, such as the pod, service and node ranges "
            "(e.g. 10.96.0.0/12)."
        ),
        json_schema_extra={"x-kubernetes-list-type": "set"},
    )
    dns: TailnetDNS | None = Field(
        default=None,
        description="The DNS hosts file this Tailnet owns. Without it no DNS entries are written.",
    )
    policy: TailnetPolicy | None = Field(
        default=None,
        description=(
            "Hands the Headscale policy to the operator. Without it the operator only reads the live "
            "policy and reports what is missing in status.policy."
        ),
    )

    @model_validator(mode="after")
    def _check(self) -> Self:
        if self.ca_bundle is not None and self.ca_secret_ref is not None:
            raise ValueError("caSecretRef: set at most one of caBundle and caSecretRef")
        if self.ca_bundle is not None and "-----BEGIN CERTIFICATE-----" not in self.ca_bundle:
            raise ValueError("caBundle: must contain at least one PEM certificate")
        if parse_go_duration(self.api_key_lifetime) < MIN_API_KEY_LIFETIME_SECONDS:
            raise ValueError("apiKeyLifetime: must be at least 1h")
        return self


class APIKeyStatus(ApiModel):
    """The operator's current working API key (never the secret itself)."""

    id: str | None = Field(default=None, max_length=64, description="Headscale ID of the key.")
    prefix: str | None = Field(default=None, max_length=64, description="Public prefix of the key.")
    created_at: Timestamp | None = Field(default=None, description="When the key was created.")
    expires_at: Timestamp | None = Field(default=None, description="When the key expires.")
    next_rotation_at: Timestamp | None = Field(
        default=None, description="When the operator will mint the next key (half the lifetime)."
    )


class PolicyStatus(ApiModel):
    """What the operator rendered, applied or found missing in the Headscale policy."""

    rendered_hash: str | None = Field(
        default=None, max_length=128, description="Hash of the last rendered policy."
    )
    applied_hash: str | None = Field(
        default=None, max_length=128, description="Hash of the policy last written to Headscale (Apply mode)."
    )
    rendered_config_map: str | None = Field(
        default=None, max_length=253, description="Name of the ConfigMap holding the rendered policy."
    )
    missing: str | None = Field(
        default=None,
        max_length=65536,
        description=(
            "When the policy is not owned: a ready-to-paste HuJSON snippet with the tagOwners, "
            "autoApprovers and grants the CRs need but the live policy lacks."
        ),
    )
    missing_tags: list[BoundedString] | None = Field(
        default=None, max_length=256, description="Tags the CRs use that the live policy does not own."
    )


class TailnetStatus(ApiModel):
    """Observed state of a Tailnet."""

    observed_generation: Generation | None = Field(
        default=None, description="The .metadata.generation the status was computed for."
    )
    conditions: Conditions | None = Field(
        default=None, description="Ready, Reachable, KeyValid and PolicyApplied conditions."
    )
    api_key: APIKeyStatus | None = Field(default=None, description="The operator's working API key.")
    server_version: str | None = Field(default=None, max_length=64, description="Version Headscale reports.")
    last_contact_time: Timestamp | None = Field(
        default=None, description="When the operator last reached the Headscale API."
    )
    policy: PolicyStatus | None = Field(default=None, description="State of the Headscale policy.")


class Tailnet(ApiModel):
    """A Headscale control server the cluster joins (cluster-scoped)."""

    model_config = ConfigDict(extra="ignore")

    api_version: Literal["tailnet.dev/v1alpha1"] = "tailnet.dev/v1alpha1"
    kind: Literal["Tailnet"] = "Tailnet"
    metadata: ObjectMeta = Field(default_factory=ObjectMeta)
    spec: TailnetSpec
    status: TailnetStatus | None = None
